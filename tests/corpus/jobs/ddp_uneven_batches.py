"""A plain DDP training loop over a hand-made data split that does not come out even: rank
$CULPRIT_RANK (default 1) gets one batch fewer. It leaves the loop and all-reduces its
validation loss (1 element) while the other rank, one batch behind, waits in DDP's gradient
all-reduce in backward (the bucket of every parameter). DDP's classic "uneven inputs" hang."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
short = role("CULPRIT_RANK", 1)
model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

x_ND, y_N1 = torch.randn(80, 16), torch.randn(80, 1)
batches = [(x_ND[i:i + 8], y_N1[i:i + 8]) for i in range(0, 80, 8)]
mine = batches[rank::world]
if rank == short:
    mine = mine[:-1]  # the remainder of an uneven split

for step, (xb, yb) in enumerate(mine):
    if step == len(batches) // world - 1:
        mark("hang")
    loss = nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()

if rank == short:
    mark("hang")
val = torch.tensor([loss.item()])
dist.all_reduce(val)  # corpus: val_allreduce
finish()
