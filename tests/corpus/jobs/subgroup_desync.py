"""Four ranks in two expert groups [0, 1] and [2, 3]; at step 2 rank $CULPRIT_RANK (default 3)
skips its group's expert-gradient all-reduce (no token reached its experts) and goes on to the
global barrier, while its partner waits in the group all-reduce."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
skipper = role("CULPRIT_RANK", 3)
groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = groups[rank // 2]


def reduce_expert_grads(t: torch.Tensor) -> None:
    dist.all_reduce(t, group=mine)  # corpus: group_allreduce


for step in range(4):
    if step == 2:
        mark("hang")
    if not (rank == skipper and step == 2):
        reduce_expert_grads(torch.ones(16))
    dist.barrier()  # corpus: barrier
dist.destroy_process_group()
