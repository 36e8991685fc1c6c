"""Three ranks; rank 0 loaded the expert checkpoint and broadcasts every expert's weights at
start-up. Rank $CULPRIT_RANK (default 2) hosts no expert (the placement gave it none), decides
it needs no expert weights and skips the broadcasts, which are on the default group and need
every rank: it goes straight to the first training all-reduce."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
empty = role("CULPRIT_RANK", 2)
n_experts = 4
local_experts = [] if rank == empty else [e for e in range(n_experts) if e % 2 == rank % 2]
weights = [torch.randn(64, 64) if rank == 0 else torch.empty(64, 64) for _ in range(n_experts)]
mark("hang")
if local_experts:
    for w in weights:
        dist.broadcast(w, src=0)  # corpus: broadcast
for _step in range(3):
    grad = torch.ones(32)
    dist.all_reduce(grad)  # corpus: allreduce
finish()
