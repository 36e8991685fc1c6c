"""Moving or stuck from recorded counters (analysis.activity; docs/DESIGN.md §9).

``fixtures/activity/recorded.json``: windows read from real gloo jobs by
``python scripts/activity_table.py --nproc 2,8 --windows 2`` (tests/e2e/jobs/chatty.py:
a loop of small all-reduces, healthy; one rank skipping an all-reduce, sleeping outside
collectives, computing, SIGSTOPped; the probe in every rank, as under watch), each over a plain
1 s window and over diagnose's own (four py-spy samples). ``chatty_healthy`` / ``chatty_stop``:
``moe-hang diagnose --out`` of the same job, healthy and with rank 1 SIGSTOPped.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from conftest import FIXTURES

from moe_hang.analysis.activity import Motion, judge
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.activity import Activity
from moe_hang.evidence.load import load_capture

REC = FIXTURES / "activity"
ROWS = json.loads((REC / "recorded.json").read_text())


def _windows(mode: str, *, ranks: str = "all", window: str | None = None) -> list[dict]:
    rows = [r for r in ROWS if r["mode"] == mode and (window is None or r["window"] == window)]
    if ranks == "odd":
        rows = [r for r in rows if r["rank"] == 1]
    elif ranks == "others":
        rows = [r for r in rows if r["rank"] != 1]
    assert rows, (mode, ranks, window)
    return rows


def _act(row: dict) -> Activity:
    a = Activity.parse(row["activity"])
    assert a is not None
    return a


@pytest.mark.parametrize("nproc", [2, 8])
def test_a_loop_of_small_all_reduces_is_moving(nproc):
    rows = [r for r in _windows("healthy") if r["nproc"] == nproc]
    for row in rows:
        j = judge(_act(row))
        assert j is not None and j.motion == Motion.MOVING, (row, j)


@pytest.mark.parametrize("mode,ranks", [("skip", "all"), ("sleep", "others"), ("stop", "all"),
                                        ("probe", "all"), ("compute", "others")])
def test_ranks_blocked_in_a_collective_are_stuck(mode, ranks):
    """The ranks that wait (every one in a skip, the others while one sleeps or computes, a
    SIGSTOPped rank and its peer, and under the probe, whose own I/O is left out)."""
    for row in _windows(mode, ranks=ranks):
        j = judge(_act(row))
        assert j is not None and j.motion == Motion.STUCK, (row, j)


def test_the_stopped_rank_says_so():
    for row in _windows("stop", ranks="odd", window="diagnose"):
        j = judge(_act(row))
        assert j is not None and j.motion == Motion.STUCK and "stopped" in j.why


def test_the_probe_is_not_mistaken_for_progress():
    """Its heartbeats write every 0.25 s: diagnose leaves its thread's I/O out; even counted
    (the plain window has no py-spy to name it), it is far below what moving needs."""
    for row in _windows("probe", window="plain"):
        a = _act(row)
        assert a.syscalls and a.syscalls > 0  # the probe's own writes were there
        assert judge(a).motion == Motion.STUCK  # type: ignore[union-attr]
    for row in _windows("probe", window="diagnose"):
        assert _act(row).syscalls == 0 and _act(row).tool_threads >= 1  # its threads


def test_nccl_counters_never_call_a_rank_stuck_nor_moving():
    for row in _windows("skip") + _windows("healthy"):
        a = replace(_act(row), backends=("nccl",))
        j = judge(a)
        assert j is not None and j.motion == Motion.CANNOT_TELL and "NCCL" in j.why
        j = judge(replace(_act(row), backends=("gloo",)), backend="nccl")  # the recorder's word
        assert j is not None and j.motion == Motion.CANNOT_TELL


def test_in_between_and_unreadable_cannot_tell():
    assert judge(None) is None
    unreadable = Activity(window_s=1.0, wakeups=500, syscalls=None, io_bytes=None, attaches=4)
    assert judge(unreadable).motion == Motion.CANNOT_TELL  # type: ignore[union-attr]
    # the main thread never woke, but a lot went through syscalls: a long transfer, or
    # another thread's I/O
    big = Activity(window_s=1.0, wakeups=6, syscalls=4000, io_bytes=50 << 20, attaches=4)
    j = judge(big)
    assert j is not None and j.motion == Motion.CANNOT_TELL and "data moved" in j.why
    few = Activity(window_s=1.0, wakeups=20, syscalls=10, io_bytes=4096, attaches=4)
    assert judge(few).motion == Motion.CANNOT_TELL  # type: ignore[union-attr]


def test_py_spy_attaches_are_not_progress():
    """Each attach wakes a blocked main thread once or twice: 4 attaches and 10 wakeups are
    what a stuck rank shows."""
    a = Activity(window_s=0.8, wakeups=10, syscalls=0, io_bytes=0, attaches=4)
    assert judge(a).motion == Motion.STUCK  # type: ignore[union-attr]
    assert judge(replace(a, attaches=0)).motion != Motion.STUCK  # type: ignore[union-attr]


def test_round_trip_through_processes_json():
    a = Activity(window_s=1.23, wakeups=5, preempted=1, syscalls=9, io_bytes=77, attaches=4,
                 tool_threads=1, stopped=True, backends=("gloo",))
    assert Activity.parse(json.loads(json.dumps(a.to_dict()))) == replace(a, window_s=1.23)
    assert Activity.parse({"window_s": 0}) is None and Activity.parse("x") is None


# ----------------------------------------------------------------------------- whole captures


def test_a_chatty_job_diagnosed_healthy_with_the_counters_quoted():
    d = diagnose(load_capture(REC / "chatty_healthy"))
    assert d.verdict == "healthy" and d.rule == "every rank moving", d.summary
    assert "in all_reduce in every sample" in d.summary
    lines = [e for e in d.evidence if "main-thread wakeups" in e]
    assert len(lines) == 2 and all("moving" in e for e in lines)


def test_a_stopped_rank_is_still_a_hang_and_the_sentence_says_why():
    d = diagnose(load_capture(REC / "chatty_stop"))
    assert d.verdict == "hang" and d.rule == "all wait in matching collectives", d.summary
    assert "does not complete: rank 1's process is stopped (SIGSTOP" in d.summary, d.summary


def test_cannot_tell_says_so_and_names_what_would_decide(tmp_path):
    """The same stuck capture on NCCL: its counters decide nothing, so the summary does not
    say the cause is outside the collective; it names watch and --fr-dir."""
    cap = tmp_path / "nccl"
    shutil.copytree(REC / "chatty_stop", cap)
    procs = json.loads((cap / "processes.json").read_text())
    for info in procs["ranks"].values():
        info["activity"]["backends"] = ["nccl"]
        info["activity"].pop("stopped", None)
    (cap / "processes.json").write_text(json.dumps(procs))
    d = diagnose(load_capture(cap))
    assert d.rule == "in matching collectives, progress unseen", d.summary
    assert d.verdict == "inconclusive" and d.certainty == "uncertain"
    assert "outside it" not in d.summary and "NCCL" in d.summary
    assert "moe-hang watch" in d.fix and "--fr-dir" in d.fix


def test_without_counters_the_sentence_claims_nothing(tmp_path):
    """An older capture (no counters): every rank in one all-reduce in every sample is not
    shown to be stuck."""
    cap = tmp_path / "old"
    shutil.copytree(REC / "chatty_stop", cap)
    procs = json.loads((cap / "processes.json").read_text())
    for info in procs["ranks"].values():
        del info["activity"]
    (cap / "processes.json").write_text(json.dumps(procs))
    d = diagnose(load_capture(cap))
    assert d.rule == "in matching collectives, progress unseen" and "outside it" not in d.summary
