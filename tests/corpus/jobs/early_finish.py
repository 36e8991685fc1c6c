"""Uneven data: rank $CULPRIT_RANK (default 1) got a shorter shard, runs out of batches after
3 steps, leaves the loop, cleans up and exits normally, while the other ranks post step 4's
gradient all-reduce and wait for it."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
short = role("CULPRIT_RANK", 1)
n_batches = 3 if rank == short else 6
for step in range(n_batches):
    if step == 3:
        mark("hang")
    grad = torch.randn(16)
    dist.all_reduce(grad)  # corpus: allreduce
print(f"rank {rank}: out of data after {n_batches} steps", flush=True)
dist.destroy_process_group()
