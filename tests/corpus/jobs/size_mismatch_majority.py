"""Three ranks all-reduce a gradient buffer; at step 3 rank $CULPRIT_RANK (default 2) posts 32
elements where the other two post 16: the odd one out is wrong."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role, warmup

rank, world = init()
odd = role("CULPRIT_RANK", 2)
warmup()
for step in range(5):
    n = 32 if (rank == odd and step == 3) else 16
    buf = torch.ones(n)
    if step == 3:
        mark("hang")
    dist.all_reduce(buf)  # corpus: allreduce
finish()
