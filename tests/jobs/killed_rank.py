"""Rank 1 is killed (SIGKILL, as by the OOM killer) mid-step; the others wait for it."""

import os
import signal

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
warmup()
mark("hang")
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
