"""`moe-hang diagnose` tells moving from stuck when every stack shows the same collective: a
communication-bound job (a loop of small all-reduces, tests/e2e/jobs/chatty.py) is healthy,
however often it is diagnosed; the same job with one rank SIGSTOPped inside the all-reduce (a
transport-level hang: every rank waits in one all-reduce) is still a hang. Real torchrun, real
gloo, real py-spy. ``MOE_HANG_CHATTY_RUNS`` sets how many diagnoses per job (default 3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import HungJob, by_rank, run_cli

from moe_hang.capture.pyspy import find_pyspy

pytestmark = [pytest.mark.e2e]

RUNS = int(os.environ.get("MOE_HANG_CHATTY_RUNS", "3"))


def _diagnose(pid: int) -> tuple[int, dict]:
    proc = run_cli("diagnose", str(pid), "--json", timeout=120)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.timeout(300 + 60 * RUNS)
@pytest.mark.parametrize("nproc", [2, 8])
def test_a_chatty_job_is_healthy_however_often_it_is_diagnosed(tmp_path, nproc):
    with HungJob("chatty.py", nproc=nproc, tmp=tmp_path, env={"RUN_S": "3600"}) as job:
        job.wait_marks(timeout=240)
        seen = []
        for _ in range(RUNS):
            code, d = _diagnose(job.popen.pid)
            seen.append((code, d["verdict"], d["rule"]))
            assert code == 0 and d["verdict"] == "healthy", (d["summary"], d["evidence"])
            assert d["rule"] == "every rank moving"
            assert len(d["ranks"]) == nproc
            # the ranks that sat in the all-reduce in every sample are moving by their counters,
            # and the evidence quotes them
            quoted = [e for e in d["evidence"] if "main-thread wakeups" in e]
            assert all(": moving (" in e for e in quoted), quoted
        assert job.popen.poll() is None  # nothing of the job changed: it still runs
        print(f"chatty x{nproc}: {seen}")


def _stop_inside_the_all_reduce(pid: int) -> None:
    """SIGSTOP ``pid`` where its main thread is inside ``all_reduce`` (read back with py-spy,
    which reads a stopped process without suspending it); else let it go on and try again."""
    exe = find_pyspy()
    assert exe is not None
    for _ in range(50):
        os.kill(pid, signal.SIGSTOP)
        dump = subprocess.run([exe, "dump", "--json", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=30)
        main = next((t for t in json.loads(dump.stdout or "[]")
                     if t.get("thread_name") == "MainThread"), None)
        if main and any(f.get("name") == "all_reduce" for f in main.get("frames", [])):
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError("rank 1 was never caught inside the all-reduce")


@pytest.mark.timeout(240)
def test_a_rank_stopped_inside_the_all_reduce_is_still_a_hang(tmp_path):
    with HungJob("chatty.py", nproc=2, tmp=tmp_path, env={"RUN_S": "3600"}) as job:
        job.wait_marks()
        ranks = job.rank_pids()
        _stop_inside_the_all_reduce(ranks[1])
        try:
            code, d = _diagnose(job.popen.pid)
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        assert code == 3 and d["verdict"] == "hang", d["summary"]
        assert d["rule"] == "all wait in matching collectives"
        assert "does not complete: rank 1's process is stopped" in d["summary"], d["summary"]
        r = by_rank(d)
        assert r[0]["collective"]["op"] == r[1]["collective"]["op"] == "all_reduce"
        stuck = [e for e in d["evidence"] if "main-thread wakeups" in e]
        assert len(stuck) == 2 and all(": stuck (" in e for e in stuck), stuck
