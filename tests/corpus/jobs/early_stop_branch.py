"""Data parallelism with a per-rank early-stopping check: every 4 steps each rank evaluates
its own validation shard and, where its loss improved, all-reduces a size-1 flag. Only rank
$CULPRIT_RANK (default 2) starts with no best loss, so at step 3 it alone posts the flag
after the step's stats all-reduce, while the others go round to step 4's gradient
all-reduces (an inner loop over the parameters); gloo aborts at the first sizes that differ.
Written for the occasion (issue 27's new-user trial, 4 ranks)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
lucky = role("CULPRIT_RANK", 2)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
best_val = float("inf") if rank == lucky else -1.0  # only one shard starts "unseen"


def evaluate() -> float:
    with torch.no_grad():
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
        return float(model(x).pow(2).mean())


for step in range(8):
    if step == 3:
        mark("hang")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # corpus: grad_allreduce
        p.grad.div_(world)
    opt.step()
    opt.zero_grad()
    stats = torch.tensor([loss.item()])
    dist.all_reduce(stats)  # corpus: stats
    if step % 4 == 3:
        val = evaluate()
        if val < best_val:  # corpus: improved_gate
            best_val = val
            improved = torch.ones(1)
            dist.all_reduce(improved)  # corpus: flag
finish()
