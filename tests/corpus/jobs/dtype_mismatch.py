"""Three ranks all-reduce the loss-scale statistics; at step 3 rank $CULPRIT_RANK (default 2)
computed them under a different precision setting and posts float64 where the others post
float32 (same number of elements)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
odd = role("CULPRIT_RANK", 2)
for step in range(5):
    dtype = torch.float64 if (rank == odd and step == 3) else torch.float32
    stats = torch.ones(16, dtype=dtype)
    if step == 3:
        mark("hang")
    dist.all_reduce(stats)  # corpus: allreduce
finish()
