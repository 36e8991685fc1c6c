"""Rank 1 computes for a long time while the others wait in the all-reduce: slow, not hung.

It stops computing when $JOB_MARKS/release exists (or after 120 s), then the job finishes."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init(timeout_s=180)
warmup()


def long_compute():
    a = torch.randn(256, 256)
    release = Path(os.environ.get("JOB_MARKS", "/nonexistent"), "release")
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        a = torch.tanh(a @ a)
    return a


mark("hang")
if rank == 1:
    long_compute()
dist.all_reduce(torch.ones(4))
dist.barrier()
dist.destroy_process_group()
