"""Metrics logging: every step the ranks all-gather their per-rank metrics, then meet at a
barrier. At step 2 rank $CULPRIT_RANK (default 1) has "nothing to log" and skips the all-gather:
it is in the barrier while the others are in the all-gather."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
for step in range(4):
    metrics = torch.tensor([float(rank), float(step)])
    if step == 2:
        mark("hang")
    if not (rank == culprit and step == 2):
        gathered = torch.empty(2 * world)
        dist.all_gather_into_tensor(gathered, metrics)  # corpus: allgather
    dist.barrier()  # corpus: barrier
dist.destroy_process_group()
