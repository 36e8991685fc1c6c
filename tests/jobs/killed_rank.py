"""Rank 1 is killed (SIGKILL, as by the OOM killer) mid-step; the others wait for it."""

import os
import signal

import torch
import torch.distributed as dist
from _common import init, mark, wait_mark, warmup

rank, world = init()
warmup()
if rank == 1:
    # die only once rank 0 is about to post its all_reduce, so that is what it waits in
    wait_mark("hang", 0)
    mark("hang")
    os.kill(os.getpid(), signal.SIGKILL)
mark("hang")
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
