"""Rank $CULPRIT_RANK (default 1) is SIGKILLed mid-step (as the kernel's OOM killer would) once
the other ranks have posted the step's all-reduce; they wait for it."""

import os
import signal

import torch
import torch.distributed as dist
from _corpus import init, mark, role, wait_for_marks, warmup

rank, world = init()
victim = role("CULPRIT_RANK", 1)
warmup()
others = set(range(world)) - {victim}
if rank == victim:
    wait_for_marks("posting", others)
    mark("hang")
    os.kill(os.getpid(), signal.SIGKILL)  # corpus: killed
mark("posting")
mark("hang")
dist.all_reduce(torch.ones(64))  # corpus: allreduce
dist.destroy_process_group()
