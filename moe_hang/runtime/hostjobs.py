"""Every distributed job on this host (``moe-hang diagnose`` without a PID): the rank
processes (runtime/rankprocs.py) grouped by their torchrun agent, else by their launcher (their
parent) and launch settings, else by rendezvous settings alone (ranks whose launcher is gone).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import psutil

from moe_hang.evidence.rankid import is_unidentified
from moe_hang.runtime.procinfo import ProcInfo, cmdline, is_launcher, is_python, read
from moe_hang.runtime.rankprocs import identify, rank_order, rank_procs


@dataclass
class JobOnHost:
    """One distributed job found on this host (``moe-hang diagnose`` without a PID)."""

    pid: int  # what to diagnose: its torchrun agent, else its launcher, else its lowest rank
    agent: int | None
    ranks: list[int]  # rank numbers; an unidentified rank is rankid.unidentified_key(pid)
    world_size: int | None
    command: str
    launcher: int | None = None

    def describe(self) -> str:
        known = [r for r in self.ranks if not is_unidentified(r)]
        if self.agent is not None:
            what = "torchrun agent"
        elif self.launcher is not None:
            what = "launcher"
        else:
            what = f"rank {min(known)}" if known else "rank (unidentified)"
        rs = known
        span = ("" if not rs else f"rank {rs[0]}" if len(rs) == 1 else
                f"ranks {rs[0]}-{rs[-1]}" if rs == list(range(rs[0], rs[-1] + 1)) else
                "ranks " + ",".join(map(str, rs)))
        n_unknown = len(self.ranks) - len(known)
        if n_unknown:
            span = ", ".join(x for x in (span, f"{n_unknown} unidentified rank"
                                         + ("s" if n_unknown > 1 else "")) if x)
        of = f" of {self.world_size}" if self.world_size else ""
        return f"PID {self.pid}  {what}, {span}{of}: {self.command[:90]}"


def find_jobs() -> list[JobOnHost]:
    """Every distributed job on this host that this user may read: rank processes (see the
    module docstring), grouped by their torchrun agent, else by their launcher (their parent)
    and launch settings, else by rendezvous settings alone (ranks whose launcher is gone). A
    rank's own children (DataLoader workers) are not ranks."""
    host = socket.gethostname()
    me = os.getpid()
    everyone = [q for p in psutil.process_iter() if p.pid != me and (q := read(p)) is not None]
    procs = {q.pid: q for q in rank_procs(everyone)}
    groups: dict[tuple[Any, ...], list[ProcInfo]] = {}
    agents: dict[tuple[Any, ...], psutil.Process] = {}
    parents: dict[tuple[Any, ...], psutil.Process] = {}
    for q in procs.values():
        parent: psutil.Process | None
        try:
            parent = psutil.Process(q.ppid) if q.ppid > 1 else None
        except psutil.Error:
            parent = None
        if parent is not None and is_launcher(parent):
            key: tuple[Any, ...] = ("agent", q.ppid)
            agents[key] = parent
        elif parent is not None and q.ppid not in procs:
            key = ("parent", q.ppid, *q.job_key)
            parents[key] = parent
        else:
            key = ("env", *q.job_key)
        groups.setdefault(key, []).append(q)
    jobs = []
    for key, members in groups.items():
        ranks = sorted(identify(members, host), key=rank_order)
        agent = agents.get(key)
        launcher = parents.get(key)
        if launcher is not None and not (is_python(launcher) or len(ranks) > 1):
            launcher = None  # a shell that started one rank: that rank is the job's face
        lead = agent or launcher or procs[ranks[0].pid].p
        cmd = " ".join(cmdline(lead)) or "?"
        jobs.append(JobOnHost(pid=lead.pid, agent=agent.pid if agent else None,
                              ranks=sorted({r.rank for r in ranks}),
                              world_size=next((r.world_size for r in ranks if r.world_size),
                                              None), command=cmd,
                              launcher=launcher.pid if launcher else None))
    return sorted(jobs, key=lambda j: j.pid)
