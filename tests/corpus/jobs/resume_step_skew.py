"""Training resumed from each rank's own record of the last step it saved: rank
$CULPRIT_RANK (default 1) kept a stale one (its last save failed), so its loop begins a step
earlier than the others'. Every 4 steps the ranks evaluate and all-reduce the validation loss
under ``if step % 4 == 0:`` — a test every rank decides alike in one pass — but the ranks are
out of step: the others' evaluation all-reduce (1 element) meets its bucket all-reduce, and
gloo aborts one of them. Written for the occasion (a new user's trial): the others were
blamed ("they broke what their earlier iterations kept"; with two ranks, the rank that
evaluated, "the test held on it alone (its own data)")."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
stale = role("CULPRIT_RANK", 1)


def resume_step() -> int:
    return 9 if rank == stale else 10  # each rank's own record of its last saved step


def evaluate(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        x_BD = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        return nn.functional.mse_loss(model(x_BD), torch.zeros(8, 1)).reshape(1)


torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = resume_step()
for step in range(start, start + 8):  # corpus: loop
    if step == 12:
        mark("hang")
    g = torch.Generator().manual_seed(100 * step + rank)
    x_BD, y_B1 = torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)
    loss = nn.functional.mse_loss(model(x_BD), y_B1)
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()
    if step % 4 == 0:  # corpus: every4
        val = evaluate(model)
        dist.all_reduce(val)  # corpus: eval
finish()
