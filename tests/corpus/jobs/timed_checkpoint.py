"""Checkpoint every SAVE_EVERY_S seconds of wall time, each rank by its own clock, as long
jobs do: rank $CULPRIT_RANK (default 1) loads a larger shard, so its timer starts later and
the others' ``dcp.save`` (its all-gather) meets its next step's bucket all-reduce. Written
for the occasion (a new user's trial): with three ranks, the fix said "make ranks 0, 2 post
the collective at the backward too: it went on without it" (they had posted it); under
`diagnose`, "every rank must post the same collectives", no line."""

import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
slow = role("CULPRIT_RANK", 1)
SAVE_EVERY_S = 1.5
ckpt_dir = tempfile.mkdtemp(prefix="moe-hang-corpus-ckpt-") if rank == 0 else ""


def train() -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    where = [ckpt_dir]
    dist.broadcast_object_list(where, src=0)
    time.sleep(0.4 if rank == slow else 0.0)  # its shard is larger: it loads longer
    last_save = time.monotonic()  # each rank's timer starts when its data is loaded
    for step in range(40):
        g = torch.Generator().manual_seed(100 * step + rank)
        x_BD, y_B1 = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x_BD), y_B1)
        opt.zero_grad()
        loss.backward()  # corpus: backward
        opt.step()
        time.sleep(0.1)
        if time.monotonic() - last_save > SAVE_EVERY_S:  # corpus: timer
            mark("hang")
            dcp.save({"model": model.state_dict()},  # corpus: save
                     checkpoint_id=f"{where[0]}/step{step}")
            last_save = time.monotonic()


try:
    train()
finally:
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
finish()
