"""A job whose ranks have all exited while its launcher is still tearing down (two torchrun
agents: the one that hosts the store leaves first, the other waits on it): watch must pass the
launcher's own exit code through, not the 1 of having ended it itself."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT

from moe_hang.commands import watch as watch_cmd
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.watchevent import EventKind, WatchEvent
from moe_hang.settings import Settings

pytestmark = pytest.mark.timeout(60)


def _launcher(code: str, tmp_path) -> LaunchedJob:
    popen = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return LaunchedJob(popen=popen, log_path=tmp_path / "job.log")


def _gone_rank() -> int:
    rank = subprocess.Popen([sys.executable, "-c", "pass"])
    rank.wait()
    return rank.pid


@pytest.mark.parametrize("code", [0, 3])
def test_the_launchers_own_code_once_every_rank_is_gone(tmp_path, code):
    job = _launcher(f"import sys, time; time.sleep(1.0); sys.exit({code})", tmp_path)
    outcome = WatchEvent(kind=EventKind.STALLED, rank_pids={0: _gone_rank()})
    try:
        watch_cmd._launcher_exit(job, outcome, lambda text: None, Settings())
        assert outcome.returncode == code
    finally:
        job.terminate(grace=1.0)


def test_a_launcher_whose_ranks_live_is_not_waited_for(tmp_path):
    job = _launcher("import time; time.sleep(30)", tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    outcome = WatchEvent(kind=EventKind.STALLED, rank_pids={0: rank.pid})
    try:
        t0 = time.monotonic()
        watch_cmd._launcher_exit(job, outcome, lambda text: None,
                                 Settings(launcher_teardown_s=30.0))
        assert time.monotonic() - t0 < 5.0  # at once: a live rank is the job, not its teardown
        assert outcome.returncode is None
    finally:
        rank.kill()
        rank.wait()
        job.terminate(grace=1.0)


def test_the_wait_is_bounded(tmp_path):
    job = _launcher("import time; time.sleep(30)", tmp_path)
    outcome = WatchEvent(kind=EventKind.STALLED, rank_pids={0: _gone_rank()})
    try:
        t0 = time.monotonic()
        watch_cmd._launcher_exit(job, outcome, lambda text: None,
                                 Settings(launcher_teardown_s=0.5))
        assert 0.4 < time.monotonic() - t0 < 5.0  # it waited, and no longer than its bound
        assert outcome.returncode is None
    finally:
        job.terminate(grace=1.0)
        assert job.poll() is not None
