"""Rank $STUCK_RANK (default 1) loops in its data loader for ever (time.sleep, waiting for a
batch that never comes) while the other waits in the all-reduce."""

import os
import time

import torch
import torch.distributed as dist
from _common import init, mark, warmup


def next_batch() -> torch.Tensor:
    while True:
        time.sleep(0.2)  # waiting for a file that never appears


rank, world = init(timeout_s=120)
warmup()
mark("hang")
x = next_batch() if rank == int(os.environ.get("STUCK_RANK", "1")) else torch.ones(4)
dist.all_reduce(x)
dist.destroy_process_group()
