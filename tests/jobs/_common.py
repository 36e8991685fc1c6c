"""Shared setup for the small hung jobs the tests diagnose (plain torch, no moe-hang)."""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def init(timeout_s: float = 60.0) -> tuple[int, int]:
    if os.environ.get("JOB_NONDUMPABLE"):
        # as in hardened containers: no ptrace without CAP_SYS_PTRACE, even for the same user
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def warmup(steps: int = 3) -> None:
    """A few healthy collectives first, as a real job would have (history for the recorder)."""
    for _ in range(steps):
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(8 * dist.get_world_size()), torch.ones(8))


def mark(name: str) -> None:
    """Tell the test where we are: $JOB_MARKS/<name>.rank<r> (no sleeping, no guessing)."""
    d = os.environ.get("JOB_MARKS")
    if d:
        Path(d, f"{name}.rank{dist.get_rank()}").write_text(str(time.time()))
