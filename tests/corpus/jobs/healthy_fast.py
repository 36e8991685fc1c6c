"""A healthy, fast job: a few steps of gradient all-reduce and an all-gather of metrics."""

import torch
import torch.distributed as dist
from _corpus import finish, init

rank, world = init()
w = torch.zeros(32)
for _step in range(10):
    grad = torch.randn(32)
    dist.all_reduce(grad)
    w -= 0.01 * grad / world
    metrics = torch.empty(world * 2)
    dist.all_gather_into_tensor(metrics, torch.tensor([float(rank), w.norm().item()]))
print(f"rank {rank}: done, |w| = {w.norm():.3f}", flush=True)
finish()
