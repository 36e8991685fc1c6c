"""DDP that skips a step whose loss is not finite, on the rank whose batch made it: ``if not
torch.isfinite(loss): continue`` before ``loss.backward()``. Rank $CULPRIT_RANK (default 1)
gets a corrupt sample at step 3 and skips its backward there, so its buckets' all-reduces
pair silently with the others' next step (the same sizes); it finishes the loop a step early
and waits in the final barrier while the others wait in the last backward. Written for the
occasion (a new user's trial): under `diagnose` the fix was "every rank must post the same
collectives", no line named."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
bad = role("CULPRIT_RANK", 1)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

for step in range(6):
    if step == 3:
        mark("hang")
    g = torch.Generator().manual_seed(100 * step + rank)
    x_BD, y_B1 = torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)
    if rank == bad and step == 3:
        x_BD[0, 0] = float("inf")  # a corrupt sample in this rank's shard
    loss = nn.functional.mse_loss(model(x_BD), y_B1)
    if not torch.isfinite(loss):  # corpus: guard
        continue
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()
dist.barrier()  # corpus: barrier
finish()
