"""A 6-stage pipeline (each stage receives from the previous rank, sends to the next) whose
ranks also all-reduce a size-1 accuracy and loss every step: at step 2 rank $CULPRIT_RANKS
also all-reduces its gradient norm, which pairs silently with the others' loss (gloo pairs
equal sizes). From fuzz seed 38502719, job 46: attached to with ``diagnose`` (stacks alone),
the stages in their send/recv are a pass on from the culprit, which is a collective behind
them all."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
# the ranks the fault is planted on: $CULPRIT_RANKS (the runner swaps them for the mirrored twin)
FAULTY = RANK in {int(r) for r in os.environ.get("CULPRIT_RANKS", "2").split(",")}
STEPS, FAULT_STEP = 4, 2
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
    if RANK > 0:
        x = torch.empty(8, 8)
        dist.recv(x, RANK - 1)  # corpus: recv
    h = torch.relu(stage(x))
    if RANK < WORLD - 1:
        dist.send(h.detach(), RANK + 1)  # corpus: send
    loss = h.square().mean()
    acc = torch.tensor([float(step % 2)])  # this rank's accuracy
    dist.all_reduce(acc)  # corpus: acc
    if FAULTY and step == FAULT_STEP:  # corpus: planted
        gnorm = torch.tensor([1.0])  # this rank also logs its gradient norm
        dist.all_reduce(gnorm)  # corpus: extra
    loss_sum = torch.tensor([loss.item()])  # the loss, for the log
    dist.all_reduce(loss_sum)  # corpus: loss
dist.barrier()  # corpus: finish
print(f"rank {RANK}: done", flush=True)
dist.destroy_process_group()
