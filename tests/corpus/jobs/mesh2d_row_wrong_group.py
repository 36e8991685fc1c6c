"""A 2x4 mesh (dp, tp) on two nodes: at step 2 a whole tp row ($CULPRIT_RANKS) posts
its dp gradient all-reduce on tp (the row completes it) and waits in the world stats;
each rank of the other row waits for its dp partner (fuzz seed 77163029 job 46)."""

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
FAULTY = RANK in {int(r) for r in os.environ.get("CULPRIT_RANKS", "4,5,6,7").split(",")}
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


mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
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
    group = tp if FAULTY and step == FAULT_STEP else dp  # corpus: planted
    dist.all_reduce(grad, group=group)  # corpus: dp_reduce
    stats = torch.zeros(4, dtype=torch.float32)
    stats[0], stats[1] = loss.item(), float(step)
    dist.all_reduce(stats)  # corpus: stats
    mine = torch.full((3,), float(RANK), dtype=torch.float32)
    seen = torch.empty(3 * WORLD, dtype=torch.float32)
    dist.all_gather_into_tensor(seen, mine, group=LOG)  # corpus: metrics
    stop = torch.tensor([float(step == STEPS - 1)])
    dist.broadcast(stop, 0)  # corpus: stop
dist.barrier()  # corpus: finish
print(f"rank {RANK}: done", flush=True)
dist.destroy_process_group()
