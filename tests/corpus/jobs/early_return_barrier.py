"""``train_step`` returns early on a batch it considers empty; the gradient all-reduce is after
the early return. At step 2 rank $CULPRIT_RANK (default 1) gets an empty batch, returns, and
meets the others at the end-of-step barrier, while they are in the all-reduce."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)


def train_step(batch: torch.Tensor) -> None:
    if batch.numel() == 0:
        return  # corpus: return
    grad = batch.sum(0)
    dist.all_reduce(grad)  # corpus: allreduce


for step in range(4):
    batch = torch.randn(0 if (rank == culprit and step == 2) else 4, 8)
    if step == 2:
        mark("hang")
    train_step(batch)
    dist.barrier()  # corpus: barrier
dist.destroy_process_group()
