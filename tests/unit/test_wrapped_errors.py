"""An exception re-raised by a wrapper that carries the original's traceback as text (torch's
DataLoader: ``KeyError: Caught KeyError in DataLoader worker process 0.`` + ``Original
Traceback ...``) is reported with the original type, message and line; what wrapped it is a
field of its own. Recorded: tests/corpus/jobs/dataloader_keyerror.py under ``moe-hang watch``
(``dataloader_keyerror_0``: rank 1's shard is corrupt; ``_1``: its mirror, rank 0's)."""

from __future__ import annotations

import pytest
from conftest import ROOT, relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.errors import log_tracebacks, unwrap, with_original
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import RankError
from moe_hang.evidence.stacks import Frame, callsite

RECORDED_AT = "/work/wt/cases"  # the checkout the fixtures were recorded in
JOB = "tests/corpus/jobs/dataloader_keyerror.py"
ORIGINAL = "\"sample 37: missing 'labels' field\""
WRAPPER = "KeyError: Caught KeyError in DataLoader worker process 0."
GETITEM, LOOP = 23, 42  # the raise in Records.__getitem__; `for x, y in loader`
RUNS = [("dataloader_keyerror_0", 1, 0), ("dataloader_keyerror_1", 0, 1)]


@pytest.mark.parametrize("name, culprit, victim", RUNS)
def test_the_job_log_gives_the_original_exception(fixtures, name, culprit, victim):
    errs = log_tracebacks((fixtures / name / "job.log").read_text())
    err = errs[culprit]
    assert (err.type, err.message, err.wrapped_by) == ("KeyError", ORIGINAL, WRAPPER)
    # where it was raised (in the worker) leads; the rank's own frames follow
    assert (err.frames[0].line, err.frames[0].function) == (GETITEM, "__getitem__")
    assert err.frames[0].file.endswith(JOB)
    assert [f.function for f in err.frames[1:4]] == ["<listcomp>", "fetch", "_worker_loop"]
    assert (err.frames[-1].line, err.frames[-1].function) == (LOOP, "<module>")
    assert callsite(err.frames) == err.frames[0]
    # the victim's traceback carries no other: it is as it was
    assert errs[victim].wrapped_by is None and errs[victim].type == "RuntimeError"
    assert "Connection closed by peer" in errs[victim].message


@pytest.mark.parametrize("name, culprit, victim", RUNS)
def test_the_probes_first_line_is_completed_from_the_log(fixtures, name, culprit, victim):
    """The probe's error.json holds the wrapper's first line and frames only; the capture
    reads the original from the job log's copy, and keeps the probe's time (it orders the
    ranks' failures)."""
    ev = load_capture(fixtures / name)
    err = ev.ranks[culprit].error
    assert err is not None
    assert (err.type, err.message, err.wrapped_by) == ("KeyError", ORIGINAL, WRAPPER)
    assert err.source == "probe" and err.time is not None
    assert (err.frames[0].line, err.frames[0].function) == (GETITEM, "__getitem__")
    assert ev.ranks[victim].error is not None and ev.ranks[victim].error.wrapped_by is None


@pytest.mark.parametrize("name, culprit, victim", RUNS)
def test_the_verdict_names_the_original_error_and_its_line(fixtures, tmp_path, name, culprit,
                                                           victim):
    run = relocated(fixtures / name, tmp_path / "run", RECORDED_AT, str(ROOT))
    d = diagnose(load_capture(run)).to_dict()
    assert d["verdict"] == "crash" and d["culprit_ranks"] == [culprit]
    assert f"KeyError: {ORIGINAL}" in d["summary"], d["summary"]
    assert f"{JOB}:{GETITEM} __getitem__" in d["summary"], d["summary"]
    assert "Caught KeyError" not in d["summary"] and f":{LOOP} " not in d["summary"]
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert (ranks[culprit]["callsite"]["line"], ranks[culprit]["callsite"]["function"]) == (
        GETITEM, "__getitem__")


def test_a_plain_exception_is_left_as_it_is():
    err = RankError("ValueError", "bad batch: NaN in labels", [Frame("/job/t.py", 9, "step")])
    assert unwrap(err) is err
    assert unwrap(err, "bad batch\nTraceback (most recent call last):\n  no frames") is err
    assert with_original(err, None) is err


def test_any_wrapper_that_embeds_a_formatted_traceback_is_unwrapped():
    """A wrapper of the user's own (``RuntimeError(f"prefetch failed:\\n{format_exc()}")``):
    the plain heading, and the last exception of the text."""
    text = ("prefetch failed:\n"
            "Traceback (most recent call last):\n"
            '  File "/job/data.py", line 30, in fetch\n'
            "    return self.read(i)\n"
            '  File "/job/data.py", line 12, in read\n'
            "    raise OSError(5, 'Input/output error')\n"
            "OSError: [Errno 5] Input/output error\n")
    outer = RankError("RuntimeError", "prefetch failed:", [Frame("/job/train.py", 40, "main")])
    err = unwrap(outer, text)
    assert (err.type, err.message) == ("OSError", "[Errno 5] Input/output error")
    assert err.wrapped_by == "RuntimeError: prefetch failed:"
    assert [(f.line, f.function) for f in err.frames] == [(12, "read"), (30, "fetch"),
                                                          (40, "main")]


def test_the_log_is_not_used_for_another_exception_than_the_probes():
    probe = RankError("ValueError", "step 3", [Frame("/job/t.py", 5, "f")], time=1.0)
    logged = RankError("KeyError", "'x'", [], wrapped_by="KeyError: Caught KeyError in "
                       "DataLoader worker process 0.")
    assert with_original(probe, logged) is probe
