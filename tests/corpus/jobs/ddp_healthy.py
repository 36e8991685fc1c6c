"""torch DDP, healthy: 8 steps of a small MLP on every rank, then exit."""

import torch
import torch.distributed as dist
from _corpus import init
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
