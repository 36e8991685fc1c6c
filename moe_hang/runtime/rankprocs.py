"""Which processes are ranks, and which rank each is (docs/DESIGN.md §14).

A rank is a process that has joined a process group, whatever started it:

- ``RANK`` in its environment (torchrun's workers: ranks from their start, as before);
- else torch's process-group threads among its threads (procinfo.joined_group): they exist
  from ``init_process_group``'s return to ``destroy_process_group``, never in a launcher nor
  in a rank's forked children (a fork keeps one thread), and they name no rank;
- else, only where no process around has joined yet (all still inside the rendezvous), a
  Python process that loads torch and that its launcher gave a rank (``SLURM_PROCID``,
  ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``: probe/launchers.py).

Its identity, most reliable first: the probe's heartbeat naming its pid (the job runs under
``watch``: rank and world from the process group itself); its launcher's variables (unless
two ranks of the job claim the same number there: one srun task per node that spawns its
ranks); else unknown here (``diagnose`` then reads the rank's own frames: commands/
identify.py), and an unknown one is keyed ``-pid`` (:mod:`moe_hang.evidence.rankid`), never
given a number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import psutil

from moe_hang.evidence.heartbeats import read_heartbeats
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.rankid import unidentified_key
from moe_hang.probe.env import ENV_DIR
from moe_hang.runtime.procinfo import ProcInfo, is_launcher, is_python, loads_torch


@dataclass
class RankProc:
    rank: int  # the rank; for a process whose rank is not known, rankid.unidentified_key(pid)
    pid: int
    host: str
    local_rank: int | None = None
    world_size: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # allowlisted only
    probe_dir: str | None = None
    create_time: float = 0.0
    identity: str = "environment"  # probe | environment | frames | unidentified

    @property
    def identified(self) -> bool:
        return self.identity != "unidentified"


def rank_order(r: RankProc) -> tuple[int, int]:
    """Identified ranks by number, then the unidentified by pid."""
    return (0, r.rank) if r.identified else (1, r.pid)


def rank_procs(procs: list[ProcInfo]) -> list[ProcInfo]:
    """The ranks among ``procs`` (module docstring): RANK, else joined; where none has joined
    yet, the Python processes a launcher gave a rank. A rank's own children (DataLoader
    workers) inherit its variables: the topmost is kept."""
    ranks = [q for q in procs if q.has_rank_var or q.joined]
    if not ranks:
        ranks = [q for q in procs if q.env_identity is not None and is_python(q.p)
                 and not is_launcher(q.p) and loads_torch(q.pid)]
    by_pid = {q.pid: q for q in ranks}
    out = []
    for q in ranks:
        parent = by_pid.get(q.ppid)
        if parent is not None and not q.joined and (
                parent.env_identity == q.env_identity or not q.has_rank_var):
            continue  # a child that inherited its parent's identity and joined nothing
        out.append(q)
    return out


def _probe_ranks(dirs: set[str]) -> dict[int, Heartbeat]:
    """pid -> the latest heartbeat of the probe in that pid (the rank it learned itself)."""
    out: dict[int, Heartbeat] = {}
    for d in dirs:
        try:
            beats = read_heartbeats(Path(d))
        except OSError:
            continue
        out.update((hb.pid, hb) for hb in beats.values() if hb.pid is not None)
    return out


def _ct(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


def identify(procs: list[ProcInfo], host: str) -> list[RankProc]:
    """Each rank process with its identity (module docstring); unknown ones keyed -pid."""
    dirs = {q.env[ENV_DIR] for q in procs if q.env and q.env.get(ENV_DIR)}
    probed = _probe_ranks(dirs)
    claims: dict[tuple[str, int], int] = {}
    for q in procs:
        ident = q.env_identity
        if ident is not None:
            claims[(ident.launcher, ident.rank)] = claims.get((ident.launcher, ident.rank), 0) + 1
    out = []
    for q in procs:
        env = q.env or {}
        base = dict(pid=q.pid, host=host, env=env, probe_dir=env.get(ENV_DIR),
                    create_time=_ct(q.p))
        hb = probed.get(q.pid)
        ident = q.env_identity
        if hb is not None:
            out.append(RankProc(rank=hb.rank, local_rank=hb.local_rank, world_size=hb.world,
                                identity="probe", **base))  # type: ignore[arg-type]
        elif ident is not None and (q.has_rank_var or claims[(ident.launcher, ident.rank)] == 1):
            out.append(RankProc(rank=ident.rank, local_rank=ident.local_rank,
                                world_size=ident.world, identity="environment",
                                **base))  # type: ignore[arg-type]
        else:
            out.append(RankProc(rank=unidentified_key(q.pid), identity="unidentified",
                                **base))  # type: ignore[arg-type]
    return out
