"""A job that checks for stuck ranks with gloo's monitored_barrier (5 s). At step 2 rank
$CULPRIT_RANK (default 1) is stuck in its data loader (waiting in time.sleep for a shard that
never comes); rank 0's monitored_barrier then raises, naming the rank that did not arrive."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
stuck = role("CULPRIT_RANK", 1)
for step in range(4):
    if step == 2:
        mark("hang")
        if rank == stuck:
            shard = Path(os.environ.get("JOB_MARKS", "/tmp"), "never-written")
            while not shard.exists():
                time.sleep(0.5)  # corpus: sleep
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))  # corpus: barrier
    dist.all_reduce(torch.ones(8))
dist.destroy_process_group()
