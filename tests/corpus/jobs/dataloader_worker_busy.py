"""A real DataLoader (one worker process per rank). At step 2 rank $CULPRIT_RANK (default 1)'s
worker spends about $BUSY_S seconds (default 25) decoding one sample (a CPU-bound loop) while
the rank's main thread waits on the loader's queue and the other rank waits in the gradient
all-reduce; then the job goes on and finishes. With STUCK=1 the worker blocks on a lock no
one releases instead: the job never goes on."""

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role
from torch.utils.data import DataLoader, Dataset

rank, world = init(timeout_s=300)
slow = role("CULPRIT_RANK", 1)
seconds = float(os.environ.get("BUSY_S", "25"))
stuck = os.environ.get("STUCK") == "1"
release = Path(os.environ.get("JOB_MARKS", "/nonexistent"), "release")
LOCK = threading.Lock()


class Shards(Dataset):
    def __len__(self) -> int:
        return 5

    def __getitem__(self, step: int) -> torch.Tensor:
        x = torch.randn(64, 64)
        if rank == slow and step == 2:
            if stuck:
                LOCK.acquire()
                LOCK.acquire()  # corpus: stuck
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds and not release.exists():
                x = torch.tanh(x @ x)  # corpus: decode
        return x.sum(0)


loader = DataLoader(Shards(), batch_size=None, num_workers=1, prefetch_factor=1)
for step, batch in enumerate(loader):  # corpus: next_batch
    if step == 1:
        mark("hang")  # the worker is now on step 2's sample (prefetch 1)
    dist.all_reduce(batch)  # corpus: allreduce
finish()
