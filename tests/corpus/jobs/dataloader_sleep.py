"""Rank $CULPRIT_RANK (default 1)'s data loader never yields another batch: its loop waits for
a file that never appears (time.sleep in a loop, for ever), while the other ranks wait in the
step's gradient all-reduce. No collective is mismatched; one rank is stuck outside them."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _corpus import init, mark, role, warmup

rank, world = init()
stuck = role("CULPRIT_RANK", 1)
warmup()


def next_batch(step: int) -> torch.Tensor:
    shard = Path(os.environ.get("JOB_MARKS", "/tmp"), f"shard-{rank}-{step}.pt")
    if rank == stuck and step == 2:
        while not shard.exists():  # the shard is never written
            time.sleep(0.5)  # corpus: sleep
    return torch.randn(32)


for step in range(5):
    if step == 2:
        mark("hang")
    batch = next_batch(step)
    dist.all_reduce(batch)  # corpus: allreduce
dist.barrier()
dist.destroy_process_group()
