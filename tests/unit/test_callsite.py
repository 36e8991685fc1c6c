"""A rank's line is the job's, never a frame of Python's own library when a frame of the job's
is below it: ``ctypes.string_at(0)`` dies inside ``ctypes/__init__.py``, and the line to show
(and open) is the job's that called it; the library frame follows it. Recorded:
tests/corpus/jobs/segv_rank.py under ``moe-hang watch`` (``segv_rank_0``: rank 1 dies of
SIGSEGV; ``_1``: its mirror, rank 0)."""

from __future__ import annotations

import io

import pytest
from conftest import ROOT, relocated
from rich.console import Console

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.stacks import (
    Frame,
    callsite,
    is_stdlib_frame,
    main_thread,
    parse_faulthandler,
)
from moe_hang.report.console import render
from moe_hang.report.words import ReportContext

RECORDED_AT = "/work/wt/cases"
JOB = "tests/corpus/jobs/segv_rank.py"
SEGV = 18  # `return ctypes.string_at(ptr)` in record_name
RUNS = [("segv_rank_0", 1, 0), ("segv_rank_1", 0, 1)]


@pytest.mark.parametrize("name, culprit, victim", RUNS)
def test_the_fatal_stack_leads_with_the_jobs_line(fixtures, name, culprit, victim):
    text = (fixtures / name / "ranks" / f"rank{culprit}.fatal.txt").read_text()
    main = main_thread(parse_faulthandler(text))
    assert main is not None
    top = main.frames[0]
    assert top.file.endswith("/lib/python3.11/ctypes/__init__.py") and is_stdlib_frame(top)
    site = callsite(main.frames)
    assert site is not None and site.file.endswith(JOB)
    assert (site.line, site.function) == (SEGV, "record_name")


def test_what_counts_as_pythons_own_library():
    own = ["/usr/lib/python3.11/queue.py", "/opt/conda/lib/python3.13t/json/decoder.py",
           "/root/.pyenv/versions/3.11.7/lib/python3.11/ctypes/__init__.py",
           "C:\\Python311\\Lib\\ctypes\\__init__.py"]
    not_own = ["/venv/lib/python3.11/site-packages/nemo_automodel/x.py",
               "/usr/lib/python3/dist-packages/numpy/core.py", "/job/train.py",
               "C:\\Python311\\Lib\\site-packages\\peft\\x.py", "/home/me/lib/python/x.py"]
    assert all(is_stdlib_frame(Frame(p, 1, "f")) for p in own)
    assert not any(is_stdlib_frame(Frame(p, 1, "f")) for p in not_own)


def test_a_stack_of_library_frames_only_keeps_its_innermost():
    """No frame of the job's at all (a thread of the interpreter's own): the library frame is
    still better than nothing."""
    frames = [Frame("/usr/lib/python3.11/selectors.py", 415, "select"),
              Frame("/usr/lib/python3.11/socketserver.py", 233, "serve_forever")]
    assert callsite(frames) == frames[0]
    torch_only = [Frame("/v/lib/python3.11/site-packages/torch/x.py", 3, "f")]
    assert callsite(torch_only) is None


@pytest.mark.parametrize("name, culprit, victim", RUNS)
def test_the_dead_ranks_line_and_next_command_are_the_jobs(fixtures, tmp_path, name, culprit,
                                                           victim):
    d = diagnose(load_capture(relocated(fixtures / name, tmp_path / "run", RECORDED_AT, str(ROOT))))
    j = d.to_dict()
    assert j["verdict"] == "rank_died" and j["culprit_ranks"] == [culprit]
    ranks = {r["rank"]: r for r in j["ranks"]}
    site = ranks[culprit]["callsite"]
    assert site["file"].endswith(JOB) and (site["line"], site["function"]) == (
        SEGV, "record_name")
    # the library frame stays in the stack, above the job's
    assert "ctypes/__init__.py:519 string_at" in ranks[culprit]["stack"][0]
    buf = io.StringIO()
    render(d, Console(file=buf, width=80, color_system=None, soft_wrap=True),
           ReportContext("watch", "moe-hang watch"))
    out = buf.getvalue()
    assert f"segv_rank.py:{SEGV} (record_name, rank {culprit})" in out, out
    assert "next: open" in out and "ctypes/__init__.py:519 (" not in out, out
    # the job's line leads, the library frame follows it
    flat = " ".join(out.split())
    assert f"segv_rank.py:{SEGV} record_name (in ctypes/__init__.py:519 string_at)" in flat, out
