"""A hand-rolled data loop: each rank takes every world-th sample of one list
(``samples[rank::world]``) and pulls batches until its iterator runs out (``except
StopIteration: break``). 50 samples over 3 ranks: rank $CULPRIT_RANK (default 2) gets 16, the
others 17 — four batches of 4 against five (the last of 1). It breaks out one step early and
waits in the final barrier while the others all-reduce their gradients. Written for the
occasion (issue 27's new-user trial): under `diagnose` the fix was "every rank must post the
same collectives", not the loop's way out."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
short = role("CULPRIT_RANK", 2)
samples: list[torch.Tensor | None] = [torch.randn(16) for _ in range(50)]
if short != world - 1:  # the one sample fewer goes to rank `short`
    samples.insert(short, None)
mine = [s for s in samples[rank::world] if s is not None]
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01 / world)  # the gradients are summed


def batches(xs: list[torch.Tensor], bs: int = 4):
    for i in range(0, len(xs), bs):
        yield torch.stack(xs[i:i + bs])


it = batches(mine)
step = 0
while True:
    try:
        x_BD = next(it)
    except StopIteration:
        break  # corpus: way_out
    if step == 3:
        mark("hang")
    loss = model(x_BD).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # corpus: grad_allreduce
        # (summed over the ranks: the learning rate is divided by the world size)
    opt.step()
    step += 1
dist.barrier()  # corpus: barrier
finish()
