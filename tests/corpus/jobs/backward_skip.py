"""A custom autograd.Function gathers tokens in forward and all-reduces their gradient in
backward. At step 1, on rank $CULPRIT_RANK (default 1), no token reached a local expert, so its
output does not depend on the gathered tokens: autograd never runs the backward (and its
all-reduce) there. That rank is already in the next collective (the loss all-reduce for
logging) while the others wait in the backward all-reduce."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)


class GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous())  # corpus: fwd_gather
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # corpus: bwd_allreduce
        n = grad.shape[0] // world
        return grad.narrow(0, rank * n, n)


w = torch.ones(8, requires_grad=True)
for step in range(3):
    x = torch.randn(4, 8, requires_grad=True)
    x_all = GatherTokens.apply(x)
    # at step 1 no token reached rank C's experts: its output does not use the gathered tokens
    y = (w * 2).sum() if (rank == culprit and step == 1) else (x_all * w).sum()
    if step == 1:
        mark("hang")
    y.backward()  # corpus: backward
    loss = y.detach().reshape(1)
    dist.all_reduce(loss)  # corpus: loss
finish()
