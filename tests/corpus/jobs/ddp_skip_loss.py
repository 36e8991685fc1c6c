"""torch DDP; each step all-reduces the loss for logging. At step 3 the rank named by
CULPRIT_RANK skips that all-reduce (a NaN guard of its own) and goes on to step 4, whose first
collective — DDP's gradient bucket, in backward — sits at an *earlier* line of the loop. gloo
pairs its bucket (577 floats) with the other's loss (1 float) and aborts the other rank."""

import torch
import torch.distributed as dist
from _corpus import init, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()
    if rank == culprit and step == 3:
        continue  # its loss looked bad: nothing logged this step
    logged = loss.detach().clone()
    dist.all_reduce(logged)  # corpus: loss
dist.barrier()
dist.destroy_process_group()
