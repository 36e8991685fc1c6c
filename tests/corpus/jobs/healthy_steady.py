"""A healthy job that keeps stepping: a small all-reduce every ~50 ms for up to $RUN_S seconds
(default 40). The runner attaches to it mid-run."""

import os
import time

import torch
import torch.distributed as dist
from _corpus import finish, init, mark

rank, world = init()
t_end = time.monotonic() + float(os.environ.get("RUN_S", "40"))
step = 0
while True:
    a = torch.randn(64, 64)
    for _ in range(20):
        a = torch.tanh(a @ a)
    done = torch.tensor([1.0 if time.monotonic() > t_end else 0.0])
    dist.all_reduce(done)  # corpus: allreduce
    if done.item() > 0:
        break
    step += 1
    if step == 20:
        mark("hang")
print(f"rank {rank}: {step} steps", flush=True)
finish()
