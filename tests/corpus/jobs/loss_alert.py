"""Each rank tells every rank when its own batch loss spikes (`all_gather_object` of an
alert); rank $CULPRIT_RANK (default 2)'s shard is noisier, so at the first step only its loss
passes the threshold and its alert meets the others' next gradient all-reduce. Written for
the occasion (a new user's trial): under `diagnose` the fix was the generic order advice."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
spiky = role("CULPRIT_RANK", 2)
scale = 3.0 if rank == spiky else 1.0  # its noisier data
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mark("hang")  # every rank gets here; the first step hangs
for step in range(8):
    g = torch.Generator().manual_seed(100 * step + rank)  # this rank's own shard
    x_BD, y_B1 = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g) * scale
    loss = torch.nn.functional.mse_loss(model(x_BD), y_B1)
    mine = loss.item()  # this rank's own batch loss
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # corpus: grads
        p.grad.div_(world)
    opt.step()
    logged_1 = loss.detach().reshape(1)
    dist.all_reduce(logged_1)  # corpus: loss
    if mine > 5.0:  # a spike on this rank's own batch
        notes: list[object] = [None] * world
        dist.all_gather_object(notes, {"rank": rank, "loss": mine})  # corpus: alert
dist.barrier()  # corpus: finish
finish()
