"""Shared setup for the small hung jobs the tests diagnose (plain torch, no moe-hang)."""

import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def init(timeout_s: float = 60.0) -> tuple[int, int]:
    if os.environ.get("JOB_NONDUMPABLE"):
        # as in hardened containers: no ptrace without CAP_SYS_PTRACE, even for the same user
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    kw = {}
    if "RANK" not in os.environ:  # srun or mpirun (launch_like.py): the job names its rank
        for r, w in (("SLURM_PROCID", "SLURM_NTASKS"),
                     ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
            if r in os.environ:
                kw = {"rank": int(os.environ[r]), "world_size": int(os.environ[w])}
                break
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s), **kw)
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
    if name == "hang" and os.environ.get("JOB_FR_DUMP_DIR"):
        _dump_recorder_when_stuck(Path(os.environ["JOB_FR_DUMP_DIR"]))


def die_once_rank0_posts() -> None:
    """SIGKILL this rank (as the OOM killer would) once rank 0 marked "hang", i.e. is about to
    post the collective it will then wait in for ever. Needs $JOB_MARKS."""
    from _wait import wait_files

    wait_files(Path(os.environ["JOB_MARKS"]), "hang.rank0", 1, timeout=60.0)
    mark("hang")
    os.kill(os.getpid(), signal.SIGKILL)


def _dump_recorder_when_stuck(directory: Path) -> None:
    """What a user's own job does without moe-hang: once its collective has been pending a
    while, write torch's Flight Recorder dump as nccl_trace_rank_<r> (torch's default name)."""
    import threading

    def status() -> list[tuple[int, int]]:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=False)
        return [(int(s["last_enqueued_collective"]), int(s["last_completed_collective"]))
                for s in json.loads(raw).get("pg_status", {}).values()]

    # the collective that hangs is the first one posted after this mark; the warm-up's last
    # one may still read as pending (gloo marks completion lazily), so wait for a new one
    before = max((e for e, _ in status()), default=-1)

    def pending() -> bool:
        return any(e > before and e > c for e, c in status())

    def dump() -> None:
        deadline = time.monotonic() + 60
        while not pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        raw = torch._C._distributed_c10d._dump_fr_trace()
        tmp = directory / f".nccl_trace_rank_{dist.get_rank()}.tmp"
        tmp.write_bytes(raw)
        tmp.rename(directory / f"nccl_trace_rank_{dist.get_rank()}")

    threading.Thread(target=dump, daemon=True).start()
