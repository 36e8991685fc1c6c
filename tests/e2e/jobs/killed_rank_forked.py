"""Rank 1 is SIGKILLed mid-step, but a worker it forked (as a fork-started DataLoader does)
still holds its sockets, so rank 0 gets no connection error and waits forever, exactly as
NCCL ranks wait for a dead peer."""

import os
import time

import torch
import torch.distributed as dist
from _common import die_once_rank0_posts, init, mark, warmup

rank, world = init()
warmup()
if os.fork() == 0:  # the "DataLoader worker": inherits the process-group sockets
    time.sleep(120)
    os._exit(0)
if rank == 1:
    die_once_rank0_posts()  # so rank 0's all_reduce is what it waits in
mark("hang")
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
