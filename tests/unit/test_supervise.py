"""watch's policy (commands/supervise.py) on a scripted monitor: what it does with a verdict
when the job itself says otherwise."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from moe_hang.analysis.diagnosis import Certainty, Diagnosis, Verdict
from moe_hang.commands.supervise import AloneOnNode, WatchOptions, supervise
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import rundir
from moe_hang.runtime.watchevent import EventKind, WatchEvent


class _Job:
    def __init__(self, rc: int | None) -> None:
        self.rc = rc

    def poll(self) -> int | None:
        return self.rc


class _Monitor:
    """Says STALLED, then what the job did next."""

    def __init__(self, rc: int | None) -> None:
        self.job = _Job(rc)
        self.held_since: float | None = None
        self.events = [WatchEvent(kind=EventKind.STALLED), WatchEvent(kind=EventKind.COMPLETED,
                                                                      returncode=0)]

    def run(self, stop: object = None) -> WatchEvent:
        return self.events.pop(0)

    def hold(self) -> None:
        self.held_since = 0.0

    def held_for(self) -> float:
        return 0.0


def _died(event: WatchEvent, kind: EventKind) -> Diagnosis:
    return Diagnosis(Verdict.RANK_DIED, "Rank 1 exited before the others.", [1],
                     certainty=Certainty.DEFINITE)


@pytest.mark.parametrize("rc", [0, None])
def test_a_job_that_exits_0_during_the_capture_is_not_ended_by_its_verdict(
        tmp_path: Path, rc: int | None) -> None:
    """The launcher exited 0 while the stall was captured: every rank finished, so the
    verdict (made on a stack older than the rank's last steps) is dropped and the job's own
    completion is reported. While the launcher still runs, the verdict stands."""
    notices: list[str] = []
    mon = _Monitor(rc)
    event, diag = supervise(mon, AloneOnNode(), _died, RunLayout(tmp_path),  # type: ignore[arg-type]
                            notices.append, WatchOptions(), threading.Event())
    if rc == 0:
        assert (event.kind, diag) == (EventKind.COMPLETED, None), notices
        assert any("finished during the capture" in n for n in notices), notices
    else:
        assert event.kind == EventKind.STALLED and diag is not None
        assert diag.verdict == Verdict.RANK_DIED and not notices


def test_a_stall_the_capture_finds_moving_is_watched_on_not_ended(tmp_path: Path) -> None:
    """The capture of a stall finds the ranks moving (healthy, likely: a rank past the
    collective its stack showed) while the launcher still runs: the job is not ended for it;
    watch goes on and reports the job's own end (a fresh-clone CI run ended such a job)."""
    notices: list[str] = []
    mon = _Monitor(None)

    def moving(event: WatchEvent, kind: EventKind) -> Diagnosis:
        return Diagnosis(Verdict.HEALTHY, "Rank 0 is making progress.", [],
                         certainty=Certainty.LIKELY)

    event, diag = supervise(mon, AloneOnNode(), moving, RunLayout(tmp_path),  # type: ignore[arg-type]
                            notices.append, WatchOptions(), threading.Event())
    assert (event.kind, diag) == (EventKind.COMPLETED, None), notices
    assert any("making progress" in n and "watched on" in n for n in notices), notices
    # the line a person saw, and the diagnosis behind it, are in the run directory
    (said,) = [json.loads(ln) for ln in RunLayout(tmp_path).watched.read_text().splitlines()]
    assert said["said"] == notices[0] and said["diagnosis"]["verdict"] == "healthy"
    assert said["capture"] is None  # this scripted capture took no snapshot


def test_each_watched_on_capture_is_kept_apart_for_analyze(tmp_path: Path) -> None:
    """The ranks rewrite their files as they move on: the capture a watched-on line came from
    is copied, as captured, to watched/<n>/ (its ranks/ from the snapshot, job.log up to the
    capture), at most WATCHED_KEPT of them, each 0700."""
    layout = RunLayout(tmp_path)
    layout.ranks_dir.mkdir()
    layout.stacks_dir.mkdir()
    layout.rank(0).heartbeat.write_text('{"as": "captured"}')
    (layout.stacks_dir / "rank0.pyspy.json").write_text("[]")
    layout.processes.write_text("{}")
    layout.job_log.write_text("before\n")
    rundir.snapshot_capture(layout)
    layout.rank(0).heartbeat.write_text('{"as": "after"}')
    with layout.job_log.open("a") as f:
        f.write("after\n")
    kept = [rundir.keep_watched(layout) for _ in range(rundir.WATCHED_KEPT + 1)]
    assert kept[0] == layout.watched_dir / "1" and kept[-1] is None
    one = RunLayout(kept[0])
    assert one.rank(0).heartbeat.read_text() == '{"as": "captured"}'
    assert one.job_log.read_text() == "before\n"
    assert (one.stacks_dir / "rank0.pyspy.json").is_file() and one.processes.is_file()
    assert oct(layout.watched_dir.stat().st_mode & 0o777) == "0o700"
    assert oct(one.root.stat().st_mode & 0o777) == "0o700"
