"""A 4x2 mesh (dp, tp): at step 3 one rank ($CULPRIT_RANKS) also all-reduces a size-1
gradient norm over the world, paired silently with the others' loss; it waits in its own
loss a pass behind its dp peers (fuzz seed 77163029 job 68)."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
# the ranks the fault is planted on: $CULPRIT_RANKS (the runner swaps them for the mirrored twin)
FAULTY = RANK in {int(r) for r in os.environ.get("CULPRIT_RANKS", "6").split(",")}
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


mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger
w = torch.randn(8, 16)  # this rank's tensor-parallel slice

for step in range(STEPS):
    if step == FAULT_STEP:
        mark("hang")
    x, y = batch(step)
    h = x @ w
    dist.all_reduce(h, group=tp)  # corpus: tp_reduce
    loss = h.square().mean()
    grad = torch.full((12,), loss.item())
    dist.all_reduce(grad, group=dp)  # corpus: dp_reduce
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
