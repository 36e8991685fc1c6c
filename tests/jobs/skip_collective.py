"""Rank 1 routes zero tokens this step and skips the dispatch all-gather (DESIGN §1, case 3)."""

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
warmup()


def dispatch(x):
    out = torch.empty(world * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(out, x)
    return out


tokens = 0 if rank == 1 else 4
mark("hang")
if tokens > 0:
    dispatch(torch.ones(4, 8))
dist.barrier()
dist.destroy_process_group()
