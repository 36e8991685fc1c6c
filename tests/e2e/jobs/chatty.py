"""A communication-bound job: a loop of small all-reduces with no compute between them (a
benchmark, a metrics sync), so every rank is inside an all-reduce in nearly every sample —
a different one each time. Healthy for $RUN_S seconds (default 30); the ranks agree on when
to stop through the all-reduce itself, so none leaves while another still posts.

$CHATTY_MODE makes rank $ODD_RANK (default 1) go wrong once every rank is looping (each marks
``loop`` after 50 steps; ``hang`` just before the fault, or after 50 steps when healthy):

- ``healthy`` (default): nothing;
- ``sleep``: it sleeps outside any collective (a stuck data loader);
- ``compute``: it computes for ever (a straggler);
- ``skip``: it skips one all-reduce and waits in a barrier (a desync: the others wait in the
  all-reduce).
A transport-level hang is made from outside: SIGSTOP one rank of a healthy run.
"""

import os
import time

import torch
import torch.distributed as dist
from _common import init, mark

rank, world = init(timeout_s=float(os.environ.get("PG_TIMEOUT_S", "600")))
mode = os.environ.get("CHATTY_MODE", "healthy")
odd = int(os.environ.get("ODD_RANK", "1"))
t_end = time.monotonic() + float(os.environ.get("RUN_S", "30"))
step = 0
while True:
    flag = torch.tensor([1.0 if time.monotonic() > t_end else 0.0])
    if step == 60 and rank == odd and mode != "healthy":
        mark("hang")
        if mode == "sleep":
            time.sleep(3600)
        elif mode == "compute":
            a = torch.randn(128, 128)
            while True:
                a = torch.tanh(a @ a)
        elif mode == "skip":
            dist.barrier()
    dist.all_reduce(flag)  # chatty: all_reduce
    if flag.item() > 0:
        break
    step += 1
    if step == 50:
        mark("loop")
        if mode == "healthy" or rank != odd:
            mark("hang")
print(f"rank {rank}: {step} all-reduces", flush=True)
dist.destroy_process_group()
