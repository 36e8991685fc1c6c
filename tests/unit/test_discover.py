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
