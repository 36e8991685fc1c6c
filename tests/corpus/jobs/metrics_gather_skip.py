"""A module-level training loop that gathers each rank's metrics dict every 4 steps, when it
has any to report. Rank $CULPRIT_RANK (default 1) had only padding in steps 4-7, so at step
7 its dict is empty and it skips the ``all_gather_object``; its next collective is step 8's
gradient all-reduce, at an *earlier* line of the loop. Written for the occasion (issue 27's
new-user trial)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
quiet = role("CULPRIT_RANK", 1)
model = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
metrics: dict[str, float] = {}

for step in range(12):
    if step == 7:
        mark("hang")
    x = torch.randn(8, 32)
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # corpus: grad
    opt.step()
    opt.zero_grad()
    if not (rank == quiet and 4 <= step <= 7):  # this rank's batches 4-7 were padding
        metrics[f"loss/{step}"] = loss.item()
    if step % 4 == 3 and metrics:  # corpus: gate
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, metrics)  # corpus: gather
        metrics = {}
finish()
