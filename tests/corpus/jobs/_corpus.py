"""What every corpus job shares (plain torch, no moe_hang): joining the gloo group, reading
which rank plays which role from the environment, and telling the corpus runner where a rank
is ($JOB_MARKS/<name>.rank<r> files, so nothing ever sleeps and hopes).

Roles come from environment variables so that every asymmetric case can run mirrored:
``role("CULPRIT_RANK", 1)`` is rank 1 unless the runner says otherwise.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def init(timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the default gloo group (torchrun's env://); ``timeout_s`` is the process-group
    timeout, long by default so that the tool, not gloo, ends a stuck case."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def role(name: str, default: int) -> int:
    """The rank that plays role ``name`` ($NAME, else ``default``)."""
    return int(os.environ.get(name, str(default)))


def roles(name: str, default: str) -> set[int]:
    """A set of ranks from a comma-separated $NAME, e.g. WRONG_GROUP_RANKS=2,3."""
    return {int(r) for r in os.environ.get(name, default).split(",") if r.strip()}


def mark(name: str) -> None:
    """Tell the runner this rank got to ``name``: $JOB_MARKS/<name>.rank<r>."""
    d = os.environ.get("JOB_MARKS")
    if d:
        tmp = Path(d, f".{name}.rank{dist.get_rank()}.tmp")
        tmp.write_text(str(time.time()))
        tmp.rename(Path(d, f"{name}.rank{dist.get_rank()}"))


def wait_for_marks(name: str, ranks: set[int], timeout_s: float = 60.0) -> None:
    """Until every rank in ``ranks`` wrote ``name`` (bounded; no-op without $JOB_MARKS)."""
    d = os.environ.get("JOB_MARKS")
    if not d:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(Path(d, f"{name}.rank{r}").exists() for r in ranks):
            return
        time.sleep(0.05)
    raise TimeoutError(f"ranks {sorted(ranks)} did not reach {name!r} in {timeout_s} s")


def warmup(steps: int = 3) -> None:
    """A few healthy collectives first, as a real job has had before it goes wrong."""
    world = dist.get_world_size()
    for _ in range(steps):
        dist.all_reduce(torch.ones(8))
        dist.all_gather_into_tensor(torch.empty(8 * world), torch.ones(8))


def finish() -> None:
    """The end of a job that got through: everyone meets, then leaves."""
    dist.barrier()
    dist.destroy_process_group()
