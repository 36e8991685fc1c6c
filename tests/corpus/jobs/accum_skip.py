"""Gradient accumulation over 4 micro-batches, counted on each rank; a batch that fails a
quality check on the rank's own data is skipped (rank $CULPRIT_RANK, default 1, has one).
Gradients are all-reduced in a helper every 4 micro-batches, a checkpoint barrier every 8
steps: at step 7 the lagging rank skips the helper and waits in the barrier. Written for the
occasion (a new user's trial): the fix was "rank 1 left the loop at the helper's `for p in
model.parameters()`" — it had returned from an earlier call; in this pass it went past the
call, through `if micro == ACCUM:`."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
bad_rank = role("CULPRIT_RANK", 1)
ACCUM = 4
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def my_batches():
    g = torch.Generator().manual_seed(rank)
    for i in range(24):
        x_BD = torch.randn(16, 8, generator=g)
        if rank == bad_rank and i == 5:
            x_BD[0, 0] = float("nan")  # one corrupt sample in this rank's shard
        yield x_BD, torch.randn(16, 1, generator=g)


def sync_grads() -> None:
    for p in model.parameters():
        grad = p.grad
        assert grad is not None
        dist.all_reduce(grad)  # corpus: sync
        grad.div_(world)


def train() -> None:
    micro = 0
    for step, (x_BD, y_B1) in enumerate(my_batches()):
        if step == 7:
            mark("hang")  # both ranks begin the step that hangs
        if torch.isnan(x_BD).any():
            continue  # skip a corrupt batch
        loss = torch.nn.functional.mse_loss(model(x_BD), y_B1) / ACCUM
        loss.backward()
        micro += 1
        if micro == ACCUM:  # corpus: gate
            sync_grads()
            opt.step()
            opt.zero_grad()
            micro = 0
        if step % 8 == 7:
            dist.barrier()  # corpus: ckpt


train()
dist.barrier()  # corpus: finish
finish()
