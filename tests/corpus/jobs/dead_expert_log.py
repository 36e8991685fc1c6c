"""A small MoE trainer that logs its metrics with async all-reduces waited at the step's end;
a rank whose routing left an expert without tokens also logs a "dead expert" counter — a
decision on its own data (no rank test). At step 3 rank $CULPRIT_RANK's (default 1) batch
sends nothing to expert 3: its size-1 counter meets the others' gradient all-reduce and gloo
aborts it. Written for the occasion (a new user's trial): the fix named the extra's line but
not the branch it sits in, and advised as for a rank-only evaluation."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
empty = role("CULPRIT_RANK", 1)  # the rank whose data starves expert 3 at step 3

experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
router = torch.nn.Linear(16, 4)
params = [p for m in (*experts, router) for p in m.parameters()]
opt = torch.optim.SGD(params, lr=0.01)


def route(x_BD: torch.Tensor, step: int) -> torch.Tensor:
    choice_B = router(x_BD).argmax(-1)
    if rank == empty and step == 3:
        choice_B = choice_B.clamp(max=2)  # this batch sends nothing to expert 3
    return choice_B


mark("hang")  # every rank gets here; step 3 hangs
for step in range(6):
    g = torch.Generator().manual_seed(100 * step + rank)  # this rank's own shard
    x_BD = torch.randn(32, 16, generator=g)
    choice_B = route(x_BD, step)
    y_BD = torch.zeros_like(x_BD)
    for e, expert in enumerate(experts):
        idx_N = (choice_B == e).nonzero().flatten()
        y_BD = y_BD.index_add(0, idx_N, expert(x_BD[idx_N]))
    loss = (y_BD ** 2).mean() + 0 * sum(p.sum() for p in params)  # every expert in the graph
    opt.zero_grad()
    loss.backward()
    handles = []
    tokens_1 = torch.tensor([float(x_BD.shape[0])])
    handles.append(dist.all_reduce(tokens_1, async_op=True))  # corpus: tokens
    counts_E = torch.bincount(choice_B, minlength=4).float()
    if (counts_E == 0).any():  # an expert got no token on this rank's batch
        dead_1 = torch.tensor([float((counts_E == 0).sum())])
        handles.append(dist.all_reduce(dead_1, async_op=True))  # corpus: dead
    flat_P = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat_P)  # corpus: grads
    off = 0
    for p in params:
        p.grad.copy_(flat_P[off:off + p.numel()].view_as(p) / world)
        off += p.numel()
    opt.step()
    loss_1 = torch.tensor([loss.item()])
    handles.append(dist.all_reduce(loss_1, async_op=True))  # corpus: loss
    for h in handles:
        h.wait()  # corpus: wait
dist.barrier()  # corpus: finish
finish()
