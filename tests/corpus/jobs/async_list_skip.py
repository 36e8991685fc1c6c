"""A pipeline (fuzz seed 40271193 job 94, kept as written so its lines match the
fixtures): each stage receives from the previous rank and sends to the next; every step
posts size-1 all-reduces async into a list waited at its end. $CULPRIT_RANKS skips its token
all-reduce once (step 3); the others pair silently until the final barrier."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
# the ranks the fault is planted on: $CULPRIT_RANKS (the runner swaps them for the mirrored twin)
FAULTY = RANK in {int(r) for r in os.environ.get("CULPRIT_RANKS", "0").split(",")}
STEPS, FAULT_STEP = 5, 3
torch.manual_seed(0)


def mark(name: str) -> None:
    """Tell the runner this rank got to ``name`` ($JOB_MARKS/<name>.rank<r>)."""
    d = os.environ.get("JOB_MARKS")
    if d:
        tmp = Path(d, f".{name}.rank{RANK}.tmp")
        tmp.write_text(str(time.time()))
        tmp.rename(Path(d, f"{name}.rank{RANK}"))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger
stage = torch.nn.Linear(8, 8)  # this rank's pipeline stage

for step in range(STEPS):
    if step == FAULT_STEP:
        mark("hang")
    x, y = batch(step)
    ntok = torch.tensor([float(x.shape[0])])  # this step's tokens, over the ranks
    pending = []  # the step's logging collectives, in flight until its end
    if not (FAULTY and step == FAULT_STEP):  # corpus: planted
        pending.append(dist.all_reduce(ntok, async_op=True))  # corpus: ntok
    if RANK > 0:
        x = torch.empty(8, 8)
        dist.recv(x, RANK - 1)  # corpus: recv
    h = torch.relu(stage(x))
    if RANK < WORLD - 1:
        dist.send(h.detach(), RANK + 1)  # corpus: send
    loss = h.square().mean()
    acc = torch.tensor([float(step % 2)])  # this rank's accuracy
    pending.append(dist.all_reduce(acc, async_op=True))  # corpus: acc
    loss_sum = torch.tensor([loss.item()])  # the loss, for the log
    pending.append(dist.all_reduce(loss_sum, async_op=True))  # corpus: loss
    for work in pending:
        work.wait()  # corpus: wait
dist.barrier()  # corpus: finish
print(f"rank {RANK}: done", flush=True)
dist.destroy_process_group()
