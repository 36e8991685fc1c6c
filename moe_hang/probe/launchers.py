"""Who a process is in its job according to the variables its launcher set (stdlib only: the
probe loads it by path inside every rank; ``diagnose`` reads other processes with it).

torchrun sets ``RANK``/``WORLD_SIZE``; Slurm's ``srun`` ``SLURM_PROCID``/``SLURM_NTASKS``; Open
MPI's ``mpirun`` ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``; MPICH and Intel MPI (PMI)
``PMI_RANK``/``PMI_SIZE``. Each launcher's variables are read together, never mixed, and the
first launcher that names a rank wins: under ``srun torchrun ...`` a worker has both ``RANK``
(its global rank) and ``SLURM_PROCID`` (its node's task), and ``RANK`` is the one.

These say what the launcher *meant*; a script may still pass another rank to
``init_process_group`` (one ``srun`` task per node that spawns its ranks itself: every rank
has its node's ``SLURM_PROCID``). Callers that can ask the process group itself do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Launcher:
    name: str
    rank: str
    world: str
    local_rank: str | None
    local_world: str | None


LAUNCHERS = (
    Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    Launcher("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    Launcher("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Launcher("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)

# every variable above: what may be read from (and written about) another process's
# environment to learn its identity; numbers, never secrets
IDENTITY_VARS = tuple(dict.fromkeys(
    v for lc in LAUNCHERS for v in (lc.rank, lc.world, lc.local_rank, lc.local_world) if v))


@dataclass(frozen=True)
class EnvIdentity:
    rank: int
    world: int | None
    local_rank: int | None
    local_world: int | None
    launcher: str  # which launcher's variables said so


def _num(env: dict[str, str], key: str | None) -> int | None:
    if key is None:
        return None
    try:
        n = int(env[key])
    except (KeyError, ValueError):
        return None
    return n if n >= 0 else None


def from_env(env: dict[str, str]) -> EnvIdentity | None:
    """The rank (and world, local rank, local world) the first launcher that set one names."""
    for lc in LAUNCHERS:
        rank = _num(env, lc.rank)
        if rank is not None:
            return EnvIdentity(rank, _num(env, lc.world), _num(env, lc.local_rank),
                               _num(env, lc.local_world), lc.name)
    return None


def local_of(env: dict[str, str]) -> tuple[int | None, int | None]:
    """(local rank, local world) from whichever launcher set them (a process whose rank comes
    from its process group still learns its place on the node here)."""
    for lc in LAUNCHERS:
        lr, lw = _num(env, lc.local_rank), _num(env, lc.local_world)
        if lr is not None or lw is not None:
            return lr, lw
    return None, None
