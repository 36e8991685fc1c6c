"""A healthy job with one long quiet moment: at step 3 rank $CULPRIT_RANK (default 0) writes a
slow checkpoint (a 12 s sleep standing for a slow filesystem) while the others already wait in
the next all-reduce. Then everything goes on and the job ends normally."""

import time

import torch
import torch.distributed as dist
from _corpus import finish, init, role

rank, world = init()
writer = role("CULPRIT_RANK", 0)
for step in range(6):
    grad = torch.randn(64)
    if step == 3 and rank == writer:
        time.sleep(12.0)  # corpus: checkpoint
    dist.all_reduce(grad)  # corpus: allreduce
print(f"rank {rank}: done", flush=True)
finish()
