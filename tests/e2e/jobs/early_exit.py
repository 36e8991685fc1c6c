"""Rank 1 finishes early: it skips the last all_reduce and exits normally, while rank 0 posts
it. gloo then fails rank 0 ("Connection closed by peer"): the culprit is rank 1, not the rank
with the error."""

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
warmup()
mark("hang")
if rank == 0:
    dist.all_reduce(torch.ones(4))
