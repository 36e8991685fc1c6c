"""Two ranks all-reduce buffers of different lengths at step 3: rank $CULPRIT_RANK (default 1)
built its gradient buffer with 32 elements, the other with 16 (e.g. a config read differently
per rank). With two ranks nothing says which one is right."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role, warmup

rank, world = init()
odd = role("CULPRIT_RANK", 1)
warmup()
for step in range(5):
    n = 32 if (rank == odd and step == 3) else 16
    buf = torch.ones(n)
    if step == 3:
        mark("hang")
    dist.all_reduce(buf)  # corpus: allreduce
finish()
