"""Two process groups over the same two ranks (a data-parallel one and an expert one). Every
step reduces over the dp group, then the ep group; at step 3 rank $CULPRIT_RANK (default 1)
takes a branch that does the ep reduction first. Each rank then waits in a different group for
the other: a cross-group order inversion."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
dp = dist.new_group(list(range(world)))
ep = dist.new_group(list(range(world)))
for step in range(5):
    g_dense, g_expert = torch.ones(16), torch.ones(8)
    if step == 3:
        mark("hang")
    if rank == culprit and step == 3:
        dist.all_reduce(g_expert, group=ep)  # corpus: ep_first
        dist.all_reduce(g_dense, group=dp)
    else:
        dist.all_reduce(g_dense, group=dp)  # corpus: dp_first
        dist.all_reduce(g_expert, group=ep)
finish()
