"""2 nodes × 2 ranks (c10d agents, or launch_like.py once per node): global rank $CRASH_RANK
(default 2) finds a corrupt shard at step 2 and raises, while every other rank goes on into
that step's all-reduce and waits for it there (each step sleeps $JOB_STEP_S first: its work).
Under srun/mpirun-like launches the rank comes from the launcher's variables (SLURM_PROCID,
OMPI_COMM_WORLD_RANK), as users write it (_common.init). CRASH_HOW=sigkill: the rank is
killed there instead (the OOM killer's way: no exception, no message)."""

import os
import signal
import time

import torch
import torch.distributed as dist
from _common import init, mark, warmup


def load_shard(step: int, rank: int) -> torch.Tensor:
    if rank == int(os.environ.get("CRASH_RANK", "2")) and step == 2:
        if os.environ.get("CRASH_HOW") == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"corrupt shard 17 on node {rank // 2}")
    return torch.ones(8)


rank, world = init()
warmup()
for step in range(4):
    time.sleep(float(os.environ.get("JOB_STEP_S", "1.0")))  # a step's work
    if step == 2:
        mark("hang")
    dist.all_reduce(load_shard(step, rank))
dist.destroy_process_group()
