"""A gather whose backward all-reduces; rank 1's output does not depend on it (no gradient
anchor), so autograd skips the backward collective there while rank 0 runs it."""

import torch
import torch.distributed as dist
from _common import init, mark, warmup

rank, world = init()
warmup()


class GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty(world * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank must get here
        return grad.narrow(0, rank * grad.shape[0] // world, grad.shape[0] // world)


w = torch.ones(8, requires_grad=True)
x = torch.ones(4, 8, requires_grad=True)
x_all = GatherTokens.apply(x)
# rank 1's experts received no token: its output ignores the gathered tokens
y = (x_all * w).sum() if rank == 0 else (w * 2).sum()
mark("hang")
y.backward()
dist.barrier()
dist.destroy_process_group()
