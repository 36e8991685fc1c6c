"""FSDP2 with gradient accumulation: each rank packs its samples into micro-batches by its
own data, and sync is on for the last one only (``set_requires_gradient_sync``). At step 2
rank $CULPRIT_RANK (default 2) has three micro-batches, the others two: after their second
backward they reduce gradients while it all-gathers parameters for its own next one (its
sync off). Written for the occasion (a new user's trial): the fix was "run a skipped block
on an empty or dummy input" — what it lacked was FSDP's gradient reduction."""

import torch
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.distributed.fsdp import fully_shard

rank, world = init()
long_rank = role("CULPRIT_RANK", 2)
torch.manual_seed(0)
blocks = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]
model = nn.Sequential(*blocks, nn.Linear(32, 1))
for block in blocks:
    fully_shard(block)
sharded = fully_shard(model)  # the same module, typed as FSDP's
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def micro_batches(step: int) -> list[torch.Tensor]:
    """Samples packed up to a token budget: a rank with longer samples gets more packs."""
    n = 3 if (rank == long_rank and step == 2) else 2
    g = torch.Generator().manual_seed(10 * step + rank)
    return [torch.randn(8, 32, generator=g) for _ in range(n)]


for step in range(4):
    if step == 2:
        mark("hang")
    packs = micro_batches(step)
    for i, x_BD in enumerate(packs):
        sharded.set_requires_gradient_sync(i == len(packs) - 1)
        loss = model(x_BD).square().mean() / len(packs)
        loss.backward()  # corpus: backward
    opt.step()
    opt.zero_grad()
finish()
