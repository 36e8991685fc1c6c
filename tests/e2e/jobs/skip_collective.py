"""Rank 1 (or $SKIP_RANK) routes zero tokens this step and skips the dispatch all-gather."""

import os

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
warmup()


def dispatch(x):
    out = torch.empty(world * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(out, x)
    return out


tokens = 0 if rank == int(os.environ.get("SKIP_RANK", "1")) else 4
mark("hang")
if tokens > 0:
    dispatch(torch.ones(4, 8))
dist.barrier()
dist.destroy_process_group()
