"""Rank 1 is killed (SIGKILL, as by the OOM killer) mid-step; the others wait for it."""


import torch
import torch.distributed as dist
from _common import die_once_rank0_posts, init, mark, warmup

rank, world = init()
warmup()
if rank == 1:
    die_once_rank0_posts()  # so rank 0's all_reduce is what it waits in
mark("hang")
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
