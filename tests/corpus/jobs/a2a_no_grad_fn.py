"""Expert-parallel dispatch the Megatron/torchtitan way, hand-written: the token counts per
rank exchanged with all_to_all_single, then the tokens with ragged splits. The exchange is
not differentiable (all_to_all_single returns a tensor with no grad_fn), so every rank's
backward raises the same RuntimeError at step 0, each on its own: no rank failed because
another left. Written for the occasion (a new-user trial, issue 27)."""

import torch
import torch.distributed as dist
from _corpus import finish, init

rank, world = init()
D, PER_RANK = 8, 2
g = torch.Generator().manual_seed(rank)
w = torch.nn.Linear(D, D)
for _step in range(4):
    x_TD = w(torch.randn(16, D, generator=g))
    expert_T = torch.randint(0, world * PER_RANK, (16,), generator=g)
    send_R = torch.bincount(expert_T, minlength=world * PER_RANK).view(world, PER_RANK).sum(1)
    recv_R = torch.empty_like(send_R)
    dist.all_to_all_single(recv_R, send_R)
    y_TD = torch.empty(int(recv_R.sum()), D)
    dist.all_to_all_single(y_TD, x_TD[expert_T.argsort()], recv_R.tolist(), send_R.tolist())
    y_TD.square().mean().backward()  # corpus: backward
    for p in w.parameters():
        dist.all_reduce(p.grad)
finish()
