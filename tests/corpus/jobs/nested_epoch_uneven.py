"""Epochs of batches from each rank's own shards; in epoch 1 rank $CULPRIT_RANK's (default 1)
holds one batch more. Gradients all-reduced per parameter, the loss per batch and the
validation accuracy per epoch: the long rank's weight gradient meets the others' accuracy
and gloo aborts one of them. Written for the occasion (a new user's trial): the fix was
"make rank 1 post the collective at the accuracy's line too" — not one more pass."""

import torch
import torch.distributed as dist
from _corpus import finish, init, role

rank, world = init()
long_rank = role("CULPRIT_RANK", 1)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def batches(epoch: int):
    n = 4 + (1 if epoch == 1 and rank == long_rank else 0)  # this rank's own shard list
    g = torch.Generator().manual_seed(epoch * 100 + rank)
    for _ in range(n):
        yield torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


for epoch in range(3):
    for x_BD, y_B1 in batches(epoch):  # corpus: batch_loop
        loss = torch.nn.functional.mse_loss(model(x_BD), y_B1)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # corpus: grad
        opt.step()
        logged_1 = loss.detach().reshape(1)
        dist.all_reduce(logged_1)  # corpus: loss
    acc_1 = torch.tensor([0.5])
    dist.all_reduce(acc_1)  # corpus: acc
dist.barrier()  # corpus: finish
finish()
