"""One job, started the ways people start jobs without torchrun: no RANK anywhere.

    python any_launcher.py spawn N   torch.multiprocessing.spawn, as in PyTorch's DDP tutorial:
                                     the spawn index is the rank passed to init_process_group
    python any_launcher.py spawn-anonymous N   the same, with no local named rank anywhere
    python any_launcher.py accelerate  one rank under accelerate launch (its PartialState)
    python any_launcher.py env       one rank of N started by srun or mpirun (launch_like.py):
                                     rank and world size from SLURM_PROCID/SLURM_NTASKS or
                                     OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE

Rank $JOB_EARLY_RANK returns early from epoch 1 (the bug) and goes on to the end-of-epoch
barrier while the others wait in that step's all_reduce. JOB_EARLY_RANK unset: healthy, to
the end; with JOB_STEADY=1, healthy steps until $JOB_MARKS/release exists. Marks (no sleeping
in the tests): pid.rank<r> (the pid) once in the group, hang.rank<r> before epoch 1,
steady.rank<r> once stepping steadily.
"""

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EARLY = int(os.environ.get("JOB_EARLY_RANK", "-1"))
MARKS = os.environ.get("JOB_MARKS")


def mark(name: str, rank: int, text: str = "") -> None:
    if MARKS:
        Path(MARKS, f"{name}.rank{rank}").write_text(text or str(time.time()))


def train_epoch(me: int, epoch: int) -> None:
    for step in range(4):
        if me == EARLY and epoch == 1 and step == 2:
            return  # the bug: this rank leaves the epoch before its last steps
        t = torch.ones(8)
        dist.all_reduce(t)


def steady(me: int) -> None:
    """Steps as a training job does (compute, then an all-reduce) until released."""
    release = Path(MARKS or ".", "release")
    step = 0
    while True:
        a = torch.randn(64, 64)
        for _ in range(20):
            a = torch.tanh(a @ a)
        done = torch.tensor([1.0 if release.exists() else 0.0])
        dist.all_reduce(done)
        if done.item() > 0:
            return
        step += 1
        if step == 20:
            mark("steady", me)


def main(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    loop(rank)


def anonymous(proc: int, nprocs: int) -> None:
    """main() where nothing in the frames says which rank this is (no local named rank)."""
    dist.init_process_group("gloo", rank=proc, world_size=nprocs,
                            timeout=datetime.timedelta(seconds=120))
    loop(proc)


def loop(me: int) -> None:
    mark("pid", me, str(os.getpid()))
    for epoch in range(3):
        if epoch == 1:
            mark("hang", me)
        train_epoch(me, epoch)
        dist.barrier()
    if os.environ.get("JOB_STEADY"):
        steady(me)
    dist.destroy_process_group()


def from_env() -> tuple[int, int]:
    for rank_var, size_var in (("SLURM_PROCID", "SLURM_NTASKS"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise SystemExit("no SLURM_PROCID or OMPI_COMM_WORLD_RANK: start me with launch_like.py")


if __name__ == "__main__":
    if sys.argv[1] in ("spawn", "spawn-anonymous"):
        world = int(sys.argv[2])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the tutorial's setup()
        mp.spawn(main if sys.argv[1] == "spawn" else anonymous, args=(world,), nprocs=world,
                 join=True)
    elif sys.argv[1] == "accelerate":  # under accelerate launch: its state joins the group
        from accelerate import PartialState

        loop(PartialState(cpu=True).process_index)
    else:
        main(*from_env())
