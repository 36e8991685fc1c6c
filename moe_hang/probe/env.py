"""What the probe shares with the tool (stdlib only, loaded by path like the probe): the
environment variables it reads, the recorder's settings it sets, the allowlist of what of a
rank's environment may ever reach a file, an atomic write, and a rank's identity."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ == "moe_hang.probe":
    from moe_hang.probe import launchers
else:  # loaded by path (watch's sitecustomize): probe.py loaded its siblings first
    launchers = sys.modules["moe_hang_probe_launchers"]

ENV_DIR = "MOE_HANG_PROBE_DIR"
ENV_OWNER = "MOE_HANG_PROBE_OWNER"
ENV_INTERVAL = "MOE_HANG_PROBE_INTERVAL"
ENV_FR_STACKS = "MOE_HANG_FR_STACKS"
FR_ENV = ("TORCH_FR_BUFFER_SIZE",)
# the recorder's ring, when the job sets none: the probe copies it into the rank's posted log
# on every tick that a group moved, and a copy costs ~7 µs an entry (scripts/fr_copy_cost.py:
# 256, ~1.8 ms, 0.7 % of a core at 4 ticks a second; 2000, ~25 ms); the log, not the ring,
# keeps the history, and says where more than 256 posted between two copies outran it (gap)
FR_BUFFER = "256"
# Only these variables of a rank's environment ever reach a file: torchrun's, and the other
# launchers' rank and size numbers (srun, mpirun: probe/launchers.py)
ENV_ALLOWLIST_EXACT = tuple(dict.fromkeys((
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", *launchers.IDENTITY_VARS)))
ENV_ALLOWLIST_PREFIX = ("TORCH_", "NCCL_")


def allowed_env(env: dict[str, str]) -> dict[str, str]:
    """The allowlisted part of an environment (never write anything else)."""
    return {k: v for k, v in env.items()
            if k in ENV_ALLOWLIST_EXACT or k.startswith(ENV_ALLOWLIST_PREFIX)}


def write_atomic(path: Path, data: bytes) -> None:
    """temp file + rename: a reader never sees half a file, even if we die mid-write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def enable_flight_recorder() -> None:
    """Must run before the first process group is created (torch reads it once)."""
    for name in FR_ENV:
        os.environ.setdefault(name, FR_BUFFER)


@dataclass(frozen=True)
class Identity:
    """A rank's place in its job, as its heartbeat says it: from torchrun's variables, or,
    for a rank found by its call to ``init_process_group``, from the process group itself."""

    rank: int
    world: int | None = None
    local_rank: int | None = None
    local_world: int | None = None

    @classmethod
    def from_torchrun_env(cls, rank: int) -> Identity:
        def num(key: str) -> int | None:
            v = os.environ.get(key)
            return int(v) if v is not None and v.isdigit() else None

        return cls(rank, num("WORLD_SIZE"), num("LOCAL_RANK"), num("LOCAL_WORLD_SIZE"))


def restart_count() -> int | None:
    """torchrun's restart count of this worker group (``--max-restarts``): 0 first."""
    v = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(v) if v.isdigit() else None


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# probe.py is loaded two ways: by path from watch's sitecustomize (``moe_hang_probe``), and
# as ``moe_hang.probe.probe`` by a job that installs the probe itself (repro's worker, run
# under watch's machinery): one process, one probe, whichever copy started it
PROBE_MODULES = ("moe_hang_probe", "moe_hang.probe.probe")


def installed_elsewhere(here: str) -> Any:
    """The probe the other copy of probe.py (``here`` is this one's name) installed, or
    None."""
    for name in PROBE_MODULES:
        mod = sys.modules.get(name)
        if name != here and mod is not None and getattr(mod, "_PROBE", None) is not None:
            return mod._PROBE
    return None


def child_of_a_rank() -> bool:
    """A rank's own child (a DataLoader worker, forked or spawned) inherits its environment,
    our mark included: it is not a rank."""
    owner = os.environ.get(ENV_OWNER)
    return bool(owner) and owner != str(os.getpid())
