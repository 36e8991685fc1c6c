"""A job torchrun restarts once (``--max-restarts 1``): in attempt 0 rank $CRASH_RANK (default
1) raises on a corrupt shard at step 2 while the other ranks wait in that step's all-reduce;
attempt 1 (TORCHELASTIC_RESTART_COUNT=1) runs to the end.

Each attempt's group keys go under a prefix of their own: torch 2.13's agent keeps one store
across restarts, and gloo's connect of attempt 1 may otherwise read attempt 0's addresses
(connection refused, or a hang in init_process_group)."""

import datetime
import os

import torch
import torch.distributed as dist
from _common import warmup

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def load_shard(step: int, rank: int) -> torch.Tensor:
    if ATTEMPT == 0 and step == 2 and rank == int(os.environ.get("CRASH_RANK", "1")):
        raise ValueError(f"corrupt shard 17 on rank {rank}")
    return torch.ones(8)


rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{ATTEMPT}", store), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
warmup()
for step in range(4):
    dist.all_reduce(load_shard(step, rank))
dist.destroy_process_group()
