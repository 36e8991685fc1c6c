"""A healthy, slow job: every step computes for about a second on every rank (a big matmul
loop), then all-reduces. Nothing is wrong; it just takes ~12 s."""

import time

import torch
import torch.distributed as dist
from _corpus import finish, init

rank, world = init()
a = torch.randn(128, 128)
for step in range(12):
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        a = torch.tanh(a @ a)
    grad = a.sum(0)
    dist.all_reduce(grad)
    if rank == 0:
        print(f"step {step} done", flush=True)
finish()
