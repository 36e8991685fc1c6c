"""Epochs of batches from each rank's own shards; in epoch 1 rank $CULPRIT_RANK's (default 1)
holds one batch more. No gradient sync (each rank trains its own head): the loss is
all-reduced per batch and the validation accuracy per epoch, one float each, so gloo pairs
the long rank's fifth loss with the others' accuracy, and so on silently to the final
barrier. Written for the occasion (a new user's trial): the short rank was named ("it
skipped 1") — the loss all-reduce is posted several times running, so only the step's
count tells one fewer from one more."""

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
        opt.step()
        logged_1 = loss.detach().reshape(1)
        dist.all_reduce(logged_1)  # corpus: loss
    acc_1 = torch.tensor([0.5])
    dist.all_reduce(acc_1)  # corpus: acc
dist.barrier()  # corpus: finish
finish()
