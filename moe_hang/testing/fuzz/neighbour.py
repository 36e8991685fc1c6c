"""A busy neighbour: a process that burns a CPU core beside a generated job for the job's
lifetime, as another tenant's job does on a shared node (the ranks, the tool and py-spy get
less of the cores than they expect). It runs in a process group of its own, ends by itself at
its deadline or as soon as the process that started it is gone, and is killed with the run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

# the neighbour's whole program: arithmetic in a loop until its deadline (argv[1] seconds)
# or until its parent (argv[2]) is gone, checked every few milliseconds
BURN = """import os, sys, time
end, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
while time.monotonic() < end and os.getppid() == parent:
    sum(i * i for i in range(20000))
"""
KILL_WAIT_S = 10.0


@contextlib.contextmanager
def busy_neighbour(limit_s: float) -> Iterator[int]:
    """A neighbour burning a core for at most ``limit_s`` seconds, killed (its whole process
    group) when the block ends; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", BURN, f"{limit_s:g}", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_WAIT_S)
