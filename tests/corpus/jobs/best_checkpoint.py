"""Keep the best checkpoint: every other step each rank scores its own validation shard and,
where the score improved, saves the model with torch.distributed.checkpoint — a collective
save, posted only on the ranks whose own score improved. At step 4 only rank $CULPRIT_RANK
(default 2) improves: its save's first all-gather meets the others' next backward (DDP's
bucket all-reduce) and every rank waits. Written for the occasion (issue 27's new-user
trial): the fix named no branch ("every rank must post the same collectives")."""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
lucky = role("CULPRIT_RANK", 2)  # whose shard scores better from step 4
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
# one directory for the run's ranks (torchrun gives them one run id)
ckpt_dir = os.path.join(tempfile.gettempdir(),
                        f"best-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}")
best = float("inf")


def validate(step: int) -> float:
    g = torch.Generator().manual_seed(7 + rank)
    x_BF, y_B1 = torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)
    with torch.no_grad():
        loss = nn.functional.mse_loss(model.module(x_BF), y_B1).item()
    # from step 2 the shards score worse; from step 4 the lucky rank's scores better
    return loss - 0.5 * (rank == lucky and step >= 4) + 0.1 * (step >= 2)


for step in range(8):
    if step == 4:
        mark("hang")
    g = torch.Generator().manual_seed(1000 * step + rank)
    x_BF, y_B1 = torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)
    loss = nn.functional.mse_loss(model(x_BF), y_B1)
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()
    if step % 2 == 0:
        val = validate(step)
        if val < best:  # corpus: improved
            best = val
            dcp.save({"model": model.state_dict()},  # corpus: save
                     checkpoint_id=ckpt_dir)
dist.barrier()
if rank == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
finish()
