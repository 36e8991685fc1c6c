"""A straggler: at step 2 rank $CULPRIT_RANK (default 1) computes for about 8 s (a matmul
loop) while the others wait in the all-reduce; then all go on and the job finishes."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init(timeout_s=300)
slow = role("CULPRIT_RANK", 1)
seconds = float(os.environ.get("STRAGGLE_S", "8"))
release = Path(os.environ.get("JOB_MARKS", "/nonexistent"), "release")
a = torch.randn(192, 192)
for step in range(4):
    if step == 2:
        mark("hang")
        if rank == slow:
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds and not release.exists():
                a = torch.tanh(a @ a)  # corpus: compute
    dist.all_reduce(a)  # corpus: allreduce
    a = a / a.norm()
finish()
