"""The posted log however a rank ends (docs/DESIGN.md §7, §8): two real gloo ranks with the
probe injected as watch injects it (tests/e2e/jobs/posted_endings.py), ended by gloo's abort
(size mismatch), SIGKILL, ``os._exit`` or an exception; the log read back by the tool's own
loader. One run per ending, shared by the tests that read it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, assert_no_survivors, free_port, job_env

from moe_hang.commands.watch import probe_env
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import RankEvidence
from moe_hang.probe.layout import RunLayout

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

JOB = JOBS / "posted_endings.py"
STEPS = 20
_RUNS: dict[str, tuple[Path, list[tuple[int, str]]]] = {}


def _line_of(mark: str) -> int:
    return next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if mark in line)


def _run(ending: str, base: Path) -> tuple[Path, list[tuple[int, str]]]:
    """(the run directory, each rank's exit code and output), once per ending."""
    if ending in _RUNS:
        return _RUNS[ending]
    job = base / JOB.name  # in the run's own directory: its processes are found by it
    shutil.copy(JOB, job)
    layout = RunLayout(base / "run")
    layout.ranks_dir.mkdir(parents=True)
    port = str(free_port())
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(2):
            env = probe_env(layout, job_env(
                RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, ENDING=ending, STEPS=str(STEPS)))
            procs.append(subprocess.Popen([sys.executable, str(job)], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert_no_survivors(str(base))
    _RUNS[ending] = (layout.root, [(p.returncode, out) for p, out in zip(procs, outs,
                                                                          strict=True)])
    return _RUNS[ending]


def _rank(root: Path, r: int) -> RankEvidence:
    return load_capture(root).ranks[r]


def _job_lines(ev: RankEvidence, i: int = -1) -> list[int]:
    return [f.line for f in ev.posted_log[i].frames if f.file.endswith(JOB.name)]


def test_gloos_abort_leaves_the_log_at_the_mismatched_collective_with_its_call_site(
        tmp_path_factory: pytest.TempPathFactory):
    root, ranks = _run("abort", tmp_path_factory.mktemp("abort"))
    code, out = ranks[1]
    assert code == -6, out  # the abort as without the probe: SIGABRT, and its message
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in out
    assert "Received data size doesn't match expected size" in out
    fatal = RunLayout(root).rank(1).fatal.read_text()
    assert "Fatal Python error: Aborted" in fatal and f"line {_line_of('MISMATCHED')}" in fatal
    ev = _rank(root, 1)
    assert ev.log_end == "abort" and ev.log_gaps == []
    assert not [n for n in ev.notes if "posted log" in n], ev.notes
    assert [c.seq for c in ev.posted_log] == list(range(1, STEPS + 4))
    last = ev.posted_log[-1]
    assert (last.op, last.input_sizes, last.completed) == ("all_gather", [[4]], False)
    assert _job_lines(ev) == [_line_of("MISMATCHED")]
    assert ev.threads and any(t.is_main for t in ev.threads)  # fatal.txt's, as before


def test_a_sigkill_leaves_the_log_as_of_the_last_tick(tmp_path_factory: pytest.TempPathFactory):
    root, ranks = _run("sigkill", tmp_path_factory.mktemp("sigkill"))
    assert ranks[1][0] == -9, ranks[1][1]
    ev = _rank(root, 1)
    assert ev.log_end is None  # nothing runs on a SIGKILL: what the ticks copied
    assert [c.seq for c in ev.posted_log] == list(range(1, STEPS + 3)) and not ev.log_gaps


def test_os_exit_leaves_the_whole_log_with_call_sites(tmp_path_factory: pytest.TempPathFactory):
    root, ranks = _run("os_exit", tmp_path_factory.mktemp("os_exit"))
    assert [code for code, _ in ranks] == [3, 3], ranks
    for r in (0, 1):
        ev = _rank(root, r)
        assert ev.log_end == "os_exit" and not ev.log_gaps
        assert [c.seq for c in ev.posted_log] == list(range(1, STEPS + 3))
        assert _job_lines(ev) == [_line_of("main thread's history")]


def test_an_exception_leaves_the_whole_log(tmp_path_factory: pytest.TempPathFactory):
    root, ranks = _run("exception", tmp_path_factory.mktemp("exception"))
    assert ranks[1][0] == 1 and "this rank fails" in ranks[1][1]
    ev = _rank(root, 1)
    assert ev.log_end == "exception" and not ev.log_gaps
    assert [c.seq for c in ev.posted_log] == list(range(1, STEPS + 3))
    assert ev.error is not None and ev.error.type == "ValueError"


def test_a_collective_posted_from_a_named_thread_carries_its_name(
        tmp_path_factory: pytest.TempPathFactory):
    root, _ranks = _run("os_exit", tmp_path_factory.mktemp("os_exit"))
    for r in (0, 1):
        ev = _rank(root, r)
        names = [c.thread_name for c in ev.posted_log]
        assert names == ["grad-sync"] * 2 + ["MainThread"] * STEPS, names
        assert len({c.thread_id for c in ev.posted_log}) == 2
        assert _job_lines(ev, 0) == [_line_of("posted from the thread")]
