"""2 nodes × 2 ranks, an expert group per node ([0,1] and [2,3]): global rank 3 (or
$SKIP_RANK) routed no token and skips its group's expert all-gather; every rank then posts the
loss all-reduce. Rank 2 waits in the expert group's all-gather, ranks 0, 1 and 3 in the
all-reduce: a deadlock that spans nodes whose culprit is rank 3."""

import os

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
local = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
groups = [dist.new_group(list(range(n, n + local))) for n in range(0, world, local)]
experts = groups[rank // local]
warmup()


def gather_experts(x):
    out = torch.empty(local * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(out, x, group=experts)
    return out


def loss_all_reduce(loss):
    dist.all_reduce(loss)


for _ in range(2):
    gather_experts(torch.ones(4, 8))
    loss_all_reduce(torch.ones(1))
tokens = 0 if rank == int(os.environ.get("SKIP_RANK", "3")) else 4
mark("hang")
if tokens > 0:
    gather_experts(torch.ones(tokens, 8))
loss_all_reduce(torch.ones(1))
dist.destroy_process_group()
