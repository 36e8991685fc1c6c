"""Finding a job's ranks from the process table: pure decisions on faked processes."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("launcher,subreaper", [(5007, 1232), (5000, 1239)])
def test_a_dead_ranks_fork_under_a_subreaper_is_not_taken_for_the_rank(monkeypatch, launcher,
                                                                       subreaper):
    """Rank 1 died; the DataLoader-style fork it left (RANK=1, one thread) was re-parented to a
    subreaper (systemd --user, a container init). One vote each for the launcher and for the
    subreaper: the fork must not win, whatever the pids."""
    from moe_hang.runtime import discover

    procs = {101: (launcher, 8), 102: (subreaper, 1)}  # pid: (ppid, threads)

    class FakeProcess:
        def __init__(self, pid):
            self.pid = pid

        def ppid(self):
            return procs[self.pid][0]

        def num_threads(self):
            return procs[self.pid][1]

    monkeypatch.setattr(discover.psutil, "Process", FakeProcess)
    cands = [discover.RankProc(rank=0, pid=101, host="h", create_time=1.0),
             discover.RankProc(rank=1, pid=102, host="h", create_time=2.0)]
    ranks, orphans = discover._split_orphans(cands)
    assert [r.pid for r in ranks] == [101] and [o.pid for o in orphans] == [102]


def test_a_job_that_ends_while_diagnosed_gets_no_verdict() -> None:
    """Its ranks exit under the capture (a healthy job finishing): one line, no verdict (an
    `inconclusive` there was a false alarm, exit 3); a job whose ranks live on is diagnosed."""
    import subprocess
    import sys

    from moe_hang.commands.diagnose import _refuse_an_ended_job
    from moe_hang.errors import MoeHangError
    from moe_hang.runtime.discover import FoundJob
    from moe_hang.runtime.rankprocs import RankProc

    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            for _ in range(2)]
    try:
        job = FoundJob(live[0].pid, None, [RankProc(i, p.pid, "h") for i, p in
                                           enumerate(live)], 2)
        _refuse_an_ended_job(job, live[0].pid, 3.0)  # alive: nothing raised
        for p in live:
            p.kill()
            p.wait()
        with pytest.raises(MoeHangError, match="ended while it was being diagnosed"):
            _refuse_an_ended_job(job, live[0].pid, 3.0)
    finally:
        for p in live:
            p.kill()
            p.wait()
