"""Four ranks; at step 2 rank $CULPRIT_RANK (default 2) fails to allocate its activation buffer
(an out-of-memory error, as torch raises it on a GPU) while the others wait in the step's
all-reduce."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 2)


def allocate_activations(step: int) -> torch.Tensor:
    if rank == culprit and step == 2:
        raise torch.OutOfMemoryError(  # corpus: raise
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 2; 79.15 GiB total capacity)")
    return torch.randn(16)


for step in range(4):
    if step == 2:
        mark("hang")
    act = allocate_activations(step)
    dist.all_reduce(act)  # corpus: allreduce
finish()
