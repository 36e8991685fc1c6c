"""2 nodes × 2 ranks (c10d agents, or launch_like.py once per node): global rank $CRASH_RANK
(default 2) finds a corrupt shard at step 2 and raises, while every other rank goes on into
that step's all-reduce and waits for it there. Under srun/mpirun-like launches the rank comes
from the launcher's variables (SLURM_PROCID, OMPI_COMM_WORLD_RANK), as users write it."""

import datetime
import os

import torch
import torch.distributed as dist
from _common import mark, warmup


def load_shard(step: int, rank: int) -> torch.Tensor:
    if rank == int(os.environ.get("CRASH_RANK", "2")) and step == 2:
        raise ValueError(f"corrupt shard 17 on node {rank // 2}")
    return torch.ones(8)


def identity() -> tuple[int, int]:
    for r, w in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    raise SystemExit("no launcher variables")


rank, world = identity()
dist.init_process_group("gloo", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
warmup()
for step in range(4):
    if step == 2:
        mark("hang")
    dist.all_reduce(load_shard(step, rank))
dist.destroy_process_group()
