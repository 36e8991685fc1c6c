"""Two gloo ranks that post some collectives and end one way (``ENDING``): what the probe's
posted log keeps of each (tests/e2e/test_posted_endings.py).

Every rank first posts two all-reduces from a short-lived thread named ``grad-sync`` (gone
before the probe's next tick), then ``STEPS`` all-reduces from the main thread. Then:

* ``abort``: an all-gather whose sizes differ (rank 0 sends 8 elements, rank 1 expects 4):
  gloo aborts rank 1 from its I/O thread (std::terminate, SIGABRT) right after it posted it;
* ``sigkill``: both sleep a while (ticks), then rank 1 SIGKILLs itself;
* ``os_exit``: both leave through ``os._exit(3)`` at once;
* ``exception``: rank 1 raises ValueError at once; rank 0 returns.

Rank 0 writes ``done.0`` in the run's parent directory when it got through (the test waits on
the ranks' exits, not on this).
"""

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

ENDING = os.environ["ENDING"]
STEPS = int(os.environ.get("STEPS", "20"))

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(4)


def side() -> None:
    for _ in range(2):
        dist.all_reduce(x)  # posted from the thread named below


t = threading.Thread(target=side, name="grad-sync")
t.start()
t.join()
for _ in range(STEPS):
    dist.all_reduce(x)  # the main thread's history

if ENDING == "abort":
    mine = torch.ones(8 if rank == 0 else 4)
    out = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(out, mine)  # MISMATCHED-GATHER
elif ENDING == "sigkill":
    time.sleep(1.5)  # several ticks (0.25 s): copied by now, even on a loaded machine
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
elif ENDING == "os_exit":
    os._exit(3)
elif ENDING == "exception" and rank == 1:
    raise ValueError("this rank fails")  # RAISED-HERE
