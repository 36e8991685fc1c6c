"""Gradient accumulation with a micro-batch count each rank takes from its own data (packing
by a token budget, as verl's dynamic batch size does): plain DDP without ``no_sync``, so every
micro-batch's backward all-reduces the gradient bucket. At step 3 rank $CULPRIT_RANK (default
1) packs its longer samples into three micro-batches where every rank used two: its third
backward all-reduce (the bucket, 1089 elements) meets the other rank's logged-loss all-reduce
(1 element) and gloo aborts both. Written for the occasion (issue 27's new-user trial): the
rank that ran the loop once more is the culprit; its earlier steps (two micro-batches, then
the loss) are what says so."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
heavy = role("CULPRIT_RANK", 1)
model = DDP(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

for step in range(6):
    n_micro = 3 if (step == 3 and rank == heavy) else 2  # the rank's own packing
    if step == 3:
        mark("hang")
    for _mb in range(n_micro):
        x_BD = torch.randn(8, 32)
        loss = model(x_BD).pow(2).mean() / n_micro
        loss.backward()  # corpus: backward
    opt.step()
    opt.zero_grad()
    logged = torch.tensor([loss.item()])
    dist.all_reduce(logged)  # corpus: loss
finish()
