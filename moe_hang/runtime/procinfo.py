"""What one process is, read once from /proc and psutil: its allowlisted environment, the
settings that tell its launch apart, whether it has joined a process group (torch's backend
threads among its threads), its parent. A process gone meanwhile reads as None: no rank.

Only the allowlisted environment variables (probe.env.allowed_env: torchrun's and the launchers'
rank variables, MASTER_*, TORCH_*, NCCL_*, plus moe-hang's own probe directory) are kept; the
launch settings (_JOB_KEYS) are compared, never kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from moe_hang.probe import launchers
from moe_hang.probe.env import ENV_DIR, allowed_env

LAUNCHER_MARKERS = ("torch.distributed.run", "torchrun", "torch.distributed.launch",
                    "torch/distributed/run.py")
# thread names torch's process-group backends give their threads (c10::setThreadName)
JOINED_THREAD_PREFIXES = ("pt_gloo", "gloo_tcp", "pt_nccl", "pt_xccl")
# what tells two ranks' launches apart (read, never kept): same values, same job
_JOB_KEYS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "SLURM_JOB_ID",
             "SLURM_STEP_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass
class ProcInfo:
    """What is read of one process, once: a process gone meanwhile is simply no rank."""

    p: psutil.Process
    env: dict[str, str] | None  # allowlisted (+ LOCAL_WORLD_SIZE, the probe directory)
    job_key: tuple[str | None, ...]
    joined: bool
    ppid: int

    @property
    def pid(self) -> int:
        return self.p.pid

    @property
    def has_rank_var(self) -> bool:
        return self.env is not None and "RANK" in self.env

    @property
    def env_identity(self) -> launchers.EnvIdentity | None:
        return launchers.from_env(self.env) if self.env is not None else None


def env_of(p: psutil.Process) -> tuple[dict[str, str] | None, tuple[str | None, ...]]:
    try:
        raw = p.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return None, ()
    env = allowed_env(raw)
    for extra in ("LOCAL_WORLD_SIZE", ENV_DIR):
        if extra in raw:
            env[extra] = raw[extra]
    return env, tuple(raw.get(k) for k in _JOB_KEYS)


def joined_group(pid: int) -> bool:
    """torch's process-group threads are among ``pid``'s threads (it has joined a group)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(JOINED_THREAD_PREFIXES):
            return True
    return False


def loads_torch(pid: int) -> bool:
    """torch's library is mapped into ``pid`` (a Python process in an srun allocation that
    never imports torch is no rank-to-be)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def read(p: psutil.Process) -> ProcInfo | None:
    if not live(p):
        return None
    env, key = env_of(p)
    try:
        ppid = p.ppid()
    except psutil.Error:
        return None
    return ProcInfo(p, env, key, joined_group(p.pid), ppid)


def cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.Error, OSError):
        return []


def is_python(p: psutil.Process) -> bool:
    parts = cmdline(p)
    try:
        names = [p.name(), os.path.basename(p.exe() or "")]
    except (psutil.Error, OSError):
        names = []
    return any("python" in (n or "").lower() for n in names + [os.path.basename(x)
                                                              for x in parts[:1]])


def is_launcher(p: psutil.Process) -> bool:
    return any(m in part for part in cmdline(p) for m in LAUNCHER_MARKERS)


def live(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
