"""Rank $PAUSE_RANK (default 1) stops for $PAUSE_S seconds once (a slow checkpoint write, a
filesystem hiccup) while the other waits in the all-reduce; then both go on and finish.
Slow, but healthy: nothing may end it."""

import os
import time

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init(timeout_s=120)
warmup()
mark("hang")
if rank == int(os.environ.get("PAUSE_RANK", "1")):
    time.sleep(float(os.environ.get("PAUSE_S", "12")))  # the pause
dist.all_reduce(torch.ones(4))
dist.barrier()
dist.destroy_process_group()
