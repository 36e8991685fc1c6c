"""Issue 28 on real processes: a rank blocked in a C call of a wait from its own line is
quiet for the probe's imports (probe/sample.py), and a rank waiting on its own busy worker
process is moving (capture/window.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from moe_hang.probe import sample
from moe_hang.runtime.procs import helpers_cpu
from moe_hang.settings import Settings


@pytest.mark.timeout(30)
def test_a_thread_blocked_in_a_c_wait_from_its_own_line_is_quiet():
    """``os.wait()`` blocks in C as ``work.wait()`` does: nothing imports until it returns."""
    import os
    import threading

    child = subprocess.Popen(["sleep", "0.5"])
    me, got = threading.get_ident(), {}

    def look() -> None:
        time.sleep(0.15)
        got["quiet"] = sample.quiet_for_imports(me)

    t = threading.Thread(target=look)
    t.start()
    try:
        os.wait()  # the innermost frame is this test's own line, in a C wait
    finally:
        t.join()
        child.poll()
    assert got["quiet"] is True


@pytest.mark.timeout(60)
def test_a_process_waiting_on_its_busy_worker_is_seen_moving():
    """A real process whose main thread blocks on a queue while its worker process spins:
    the window reads its helper's CPU and calls it moving; the same process with an idle
    worker is not."""
    pytest.importorskip("psutil")
    from moe_hang.capture import window

    code = textwrap.dedent("""
        import multiprocessing as mp, sys, time
        def spin(q, busy):
            end = time.monotonic() + 30
            while busy and time.monotonic() < end:
                sum(range(10000))
            time.sleep(30)
        if __name__ == "__main__":
            q = mp.Queue()
            w = mp.Process(target=spin, args=(q, sys.argv[1] == "busy"), daemon=True)
            w.start()
            print("ready", flush=True)
            q.get(timeout=30)  # the main thread waits on its worker
    """)
    for mode, want in (("busy", True), ("idle", False)):
        p = subprocess.Popen([sys.executable, "-c", code, mode], stdout=subprocess.PIPE,
                             start_new_session=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            time.sleep(0.5)
            got = window.sample_window({0: p.pid}, Settings(sample_interval_s=0.5), samples=2,
                                       locals_last=False)[0]
            assert (got.helpers_cores > window.BUSY_CORES) is want, got.helpers_cores
            if got.moved is not None:
                assert got.moved is want
            assert helpers_cpu(p.pid)  # its worker is a helper
        finally:
            import os
            import signal
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
