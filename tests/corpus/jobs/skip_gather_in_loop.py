"""Each iteration all-reduces, then all-gathers the tokens it routed here — unless it routed
none: at iteration 4 the rank named by CULPRIT_RANK has no token (the data decides, not a
rank condition), skips its all-gather and goes on to iteration 5's all-reduce, at an earlier
line of the loop. One rank waits in the all-gather, the other in the all-reduce."""

import torch
import torch.distributed as dist
from _corpus import init, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)


def tokens_for(it: int) -> int:
    return 0 if (it == 4 and rank == culprit) else 7  # this rank's batch at iteration it


x = torch.ones(16)
for it in range(8):
    dist.all_reduce(x)  # corpus: reduce
    x = x / world
    if tokens_for(it) > 0:
        out = torch.empty(16 * world)
        dist.all_gather_into_tensor(out, x)  # corpus: gather
dist.barrier()
dist.destroy_process_group()
