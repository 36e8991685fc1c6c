"""A training loop in which one rank ($CULPRIT_RANK, default 1) hits a bad batch at step 2 and
raises, while the other ranks go on into that step's gradient all-reduce and wait for it."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
torch.manual_seed(rank)
w = torch.zeros(16)

for step in range(5):
    labels = torch.randn(16)
    if rank == culprit and step == 2:
        labels[3] = float("nan")
    if torch.isnan(labels).any():
        raise ValueError("bad batch: NaN in labels")  # corpus: raise
    grad = labels - w
    if step == 2:
        mark("hang")
    dist.all_reduce(grad)  # corpus: allreduce
    w += 0.1 * grad / world

dist.barrier()
dist.destroy_process_group()
