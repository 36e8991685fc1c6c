"""Validate every 2 epochs on each rank's own validation files, the loss averaged over ranks
batch by batch: rank $CULPRIT_RANK (default 2) holds a batch fewer, so it returns from
``validate()`` and its next epoch's bucket all-reduce meets the others' last validation
all-reduce; gloo aborts one of them. Written for the occasion (a new user's trial): the fix
was "make rank 2 post the collective at validate's all-reduce too: it went on to train
without it" — not the loop it left."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
short = role("CULPRIT_RANK", 2)


def val_batches() -> list[torch.Tensor]:
    n = 3 if rank == short else 4  # each rank's own validation files
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 10 + i))
            for i in range(n)]


def validate(model: nn.Module) -> float:
    model.eval()
    total_2 = torch.zeros(2)
    with torch.no_grad():
        for x_BD in val_batches():  # corpus: val_loop
            loss = model(x_BD).pow(2).mean()
            batch_2 = torch.stack([loss, torch.tensor(1.0)])
            dist.all_reduce(batch_2)  # corpus: val_allreduce
            total_2 += batch_2
    model.train()
    return (total_2[0] / total_2[1]).item()


def train() -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(4):
        if epoch == 1:
            mark("hang")
        for i in range(3):
            g = torch.Generator().manual_seed(1000 * epoch + 10 * i + rank)
            x_BD, y_B1 = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            loss = nn.functional.mse_loss(model(x_BD), y_B1)
            opt.zero_grad()
            loss.backward()  # corpus: backward
            opt.step()
        if epoch % 2 == 1:
            validate(model)


train()
finish()
