"""The monitor when ranks run without the probe (watch by sampling, runtime/monitor.py): a
real process tree with a rank identity and no heartbeat; the sampling rounds are given (what
capture/window.py would have read), so the stall rule itself is what is tested."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.monitor import Monitor
from moe_hang.runtime.watchevent import EventKind, RoundRank, WatchSettings

pytestmark = pytest.mark.timeout(60)

# a launcher whose one child is a "rank" (RANK in its environment) that never beats
TREE = ("import os, subprocess, sys\n"
        "env = dict(os.environ, RANK='0', WORLD_SIZE='1', LOCAL_WORLD_SIZE='1')\n"
        "subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'], env=env)\n")


def _monitor(tmp: Path, rounds: list[RoundRank], notices: list[str]) -> tuple[Monitor, LaunchedJob]:
    popen = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={k: v for k, v in os.environ.items() if k != "RANK"})
    job = LaunchedJob(popen=popen, log_path=tmp / "job.log")
    seen = iter(rounds)

    def sampler(pids: dict[int, int]) -> dict[int, RoundRank]:
        assert list(pids) == [0]
        return {0: next(seen, rounds[-1])}

    s = WatchSettings(probe_dir=tmp / "ranks", world=None, stall_s=1.0, poll_s=0.05,
                      refresh_s=0.2, probe_grace_s=0.3, watch_unprobed=True,
                      straggler_notice=True, startup_timeout_s=float("inf"))
    return Monitor(job, s, on_notice=notices.append, sampler=sampler), job


def _run(mon: Monitor, within_s: float) -> EventKind:
    deadline = time.monotonic() + within_s
    return mon.run(stop=lambda: time.monotonic() > deadline).kind


def test_stuck_in_a_collective_is_a_stall_after_stall_s(tmp_path):
    notices: list[str] = []
    stuck = RoundRank(moved=False, fingerprint=[["t.py", 3, "f"]], in_collective=True)
    mon, job = _monitor(tmp_path, [stuck], notices)
    try:
        t0 = time.monotonic()
        ev = mon.run()
        assert ev.kind == EventKind.STALLED and "by sampling" in ev.reason
        assert ev.sampled and ev.rank_pids and ev.ranks() == [0] and ev.world_size() == 1
        assert time.monotonic() - t0 >= 1.0 and mon.rounds >= 2
        assert len(notices) == 1 and notices[0].startswith("the probe is not running")
    finally:
        job.terminate(grace=1.0)


def test_moving_ranks_never_stall_and_a_held_stall_resumes(tmp_path):
    notices: list[str] = []
    moving = RoundRank(moved=True, fingerprint=[["t.py", 3, "f"]], in_collective=True)
    mon, job = _monitor(tmp_path, [moving], notices)
    try:
        assert _run(mon, 4.0) == EventKind.REQUESTED  # nothing happened in 4 stall periods
        mon.hold()
        assert mon.run().kind == EventKind.RESUMED
        assert len(notices) == 1
    finally:
        job.terminate(grace=1.0)


def test_a_stack_that_changes_between_rounds_is_moving(tmp_path):
    rounds = [RoundRank(moved=False, fingerprint=[["t.py", n, "f"]], in_collective=True)
              for n in range(100)]
    mon, job = _monitor(tmp_path, rounds, [])
    try:
        assert _run(mon, 4.0) == EventKind.REQUESTED
    finally:
        job.terminate(grace=1.0)
