"""4 ranks, two expert groups [0,1] and [2,3]; rank 3 skips its group's all-reduce."""

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = groups[rank // 2]
warmup()
for _ in range(2):
    dist.all_reduce(torch.ones(4), group=mine)


def reduce_expert_grads(t):
    dist.all_reduce(t, group=mine)


mark("hang")
if rank != 3:
    reduce_expert_grads(torch.ones(16))
dist.barrier()
dist.destroy_process_group()
