"""Find the ranks of a running job from one PID: its launcher (torchrun's agent, mp.spawn's
parent, a srun-like script, a shell), one of its ranks, or a rank's own child. Which processes
are ranks and which rank each is: runtime/rankprocs.py; every job on this host:
runtime/hostjobs.py.

Of the launcher's environment, only what says where the job's store is (PET_*, SLURM_JOB_ID,
SLURM_STEP_ID) is read, for that, and never written.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import psutil

from moe_hang.errors import MoeHangError
from moe_hang.runtime.hostjobs import JobOnHost, find_jobs
from moe_hang.runtime.procinfo import ProcInfo, env_of, is_launcher, is_python, live, read
from moe_hang.runtime.rankprocs import RankProc, identify, rank_order, rank_procs

__all__ = ["FoundJob", "JobOnHost", "RankProc", "check_target", "find_job", "find_jobs",
           "launcher_of", "rank_order"]

_ANCESTORS = 4  # how far up from a non-rank (a DataLoader worker) to look for its rank


@dataclass
class FoundJob:
    target: int
    agent: int | None
    ranks: list[RankProc]
    world_size: int | None
    # processes that carry a RANK but are not ranks: children a dead rank left behind
    orphans: list[RankProc] = field(default_factory=list)
    launcher: int | None = None  # the ranks' parent when it is not a torchrun agent

    def unidentified(self) -> list[RankProc]:
        return [r for r in self.ranks if not r.identified]

    def missing_ranks(self) -> list[int]:
        if not self.world_size or self.unidentified():
            # a rank whose number is unknown may be any of the missing ones: name none
            return []
        # on one node we can only expect the local ranks of this job
        local_world = {int(r.env.get("LOCAL_WORLD_SIZE", 0) or 0) for r in self.ranks}
        found = {r.rank for r in self.ranks}
        if len(local_world) == 1 and (lw := local_world.pop()) and lw < self.world_size:
            nodes = {r.rank // lw for r in self.ranks}
            expected = {n * lw + i for n in nodes for i in range(lw)}
        else:
            expected = set(range(self.world_size))
        return sorted(expected - found)


def check_target(pid: int, *, python: bool = True) -> psutil.Process:
    """The process behind ``pid``, or a one-line :class:`MoeHangError` saying why not.
    ``python``: refuse a process that is not Python (a rank always is; a launcher — srun,
    mpirun, a shell — need not be)."""
    if pid <= 0:
        raise MoeHangError(f"PID {pid} is not a valid process id")
    if pid == 1:
        raise MoeHangError("PID 1 is the init process, not a training job")
    if pid == os.getpid():
        raise MoeHangError(f"PID {pid} is moe-hang itself, not a training job")
    try:
        p = psutil.Process(pid)
        status = p.status()
    except psutil.NoSuchProcess:
        raise MoeHangError(f"no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise MoeHangError(f"PID {pid}: permission denied reading the process") from None
    if status == psutil.STATUS_ZOMBIE:
        raise MoeHangError(f"PID {pid} is a zombie (it exited and was not reaped): "
                           "there is nothing left to diagnose")
    try:
        owner = p.uids().real
    except (psutil.Error, OSError):
        owner = None
    if os.geteuid() != 0 and owner is not None and owner != os.geteuid():
        try:
            user = p.username()
        except (psutil.Error, KeyError):
            user = str(owner)
        raise MoeHangError(f"PID {pid} belongs to user {user}; moe-hang only attaches to your "
                           "own processes unless run as root")
    if python and not is_python(p):
        raise MoeHangError(f"PID {pid} ({p.name()}) is not a Python process")
    return p


# ----------------------------------------------------------------------------- a job


def _ranks_under(root: psutil.Process, host: str) -> list[RankProc]:
    try:
        kids = root.children(recursive=True)
    except psutil.Error:
        kids = []
    procs = [q for k in kids if (q := read(k)) is not None]
    found: dict[int, RankProc] = {}
    for rp in identify(rank_procs(procs), host):
        found.setdefault(rp.rank, rp)
    return sorted(found.values(), key=rank_order)


def _same_job(a: RankProc, b: RankProc) -> bool:
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
    return all(a.env.get(k) == b.env.get(k) for k in keys)


def _is_rank(q: ProcInfo) -> bool:
    return q.has_rank_var or q.joined


def _parent(p: psutil.Process) -> psutil.Process | None:
    try:
        parent = p.parent()
    except psutil.Error:
        return None
    return parent if parent is not None and parent.pid > 1 and live(parent) else None


def _rank_above(p: psutil.Process) -> ProcInfo | None:
    """The nearest ancestor that is a rank (``p`` is its DataLoader or compile worker)."""
    cur: psutil.Process | None = p
    for _ in range(_ANCESTORS):
        cur = _parent(cur) if cur is not None else None
        if cur is None:
            return None
        q = read(cur)
        if q is not None and _is_rank(q):
            return q
    return None


def find_job(pid: int) -> FoundJob:
    """All rank processes of the job ``pid`` belongs to, on this machine."""
    p = check_target(pid, python=False)
    host = socket.gethostname()
    me = read(p)
    if me is not None and me.env is None:
        raise MoeHangError(f"PID {pid}: cannot read its environment: no ptrace permission",
                           hint="run as root, add CAP_SYS_PTRACE, or set "
                                "kernel.yama.ptrace_scope=0")
    if me is None:
        raise MoeHangError(f"no process with PID {pid}")
    under = [] if _is_rank(me) else _ranks_under(p, host)
    if not under and not _is_rank(me):
        above = _rank_above(p)
        if above is not None:
            me = above  # a rank's own child: its rank's job
    if under:  # a launcher: torchrun's agent, mp.spawn's parent, a script, srun, a shell
        agent = p if is_launcher(p) else None
        return _job(pid, agent, None if agent else p.pid, under)
    if not _is_rank(me):
        if not is_python(p):
            raise MoeHangError(f"PID {pid} ({p.name()}) is not a Python process")
        if is_launcher(p):
            raise MoeHangError(f"PID {pid} is a torchrun agent with no live rank processes "
                               "(the job has ended or not started)")
        raise MoeHangError(f"PID {pid} is a Python process but not a torch.distributed job: "
                           "neither it nor any process under it has joined a process group "
                           "(no RANK in its environment, no process-group threads)")
    parent = _parent(me.p)
    if parent is not None and is_launcher(parent):
        return _job(pid, parent, None, _ranks_under(parent, host))
    if parent is not None and not me.has_rank_var:
        # its siblings under the same launcher, of the same launch (a shell may have started
        # other jobs too)
        ranks = [r for r in _ranks_under(parent, host)
                 if _key_of(r.pid) in (me.job_key, None)]
        if any(r.pid == me.pid for r in ranks):
            return _job(pid, None, parent.pid, ranks)
    # RANK set by something else than torchrun (a script, mpirun with RANK exported), or its
    # launcher is gone: the ranks on this host with the same rendezvous settings, and the
    # children a dead rank left behind
    mine = identify([me], host)[0]
    ranks = []
    for q in psutil.process_iter():
        r = read(q) if q.pid != os.getpid() else None
        if r is None or not r.has_rank_var:
            continue
        rp = identify([r], host)[0]
        if _same_job(rp, mine):
            ranks.append(rp)
    if not any(r.pid == me.pid for r in ranks):
        ranks.append(mine)
    ranks, orphans = _split_orphans(ranks)
    # their launcher, where it is still theirs (accelerate's, a script's)
    launcher = parent.pid if parent is not None and all(
        _ppid(r.pid) == parent.pid for r in ranks) else None
    job = _job(pid, None, launcher, ranks)
    job.orphans = orphans
    return job


def _ppid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def _key_of(pid: int) -> tuple[str | None, ...] | None:
    try:
        return env_of(psutil.Process(pid))[1]
    except psutil.Error:
        return None


def _job(target: int, agent: psutil.Process | None, launcher: int | None,
         ranks: list[RankProc]) -> FoundJob:
    if not ranks:
        raise MoeHangError(f"PID {target} has no live rank processes "
                           "(the job has ended or not started)")
    world = next((r.world_size for r in ranks if r.world_size), None)
    return FoundJob(target=target, agent=agent.pid if agent else None,
                    ranks=sorted(ranks, key=rank_order), world_size=world, launcher=launcher)


def _split_orphans(cands: list[RankProc]) -> tuple[list[RankProc], list[RankProc]]:
    """Ranks are siblings (one launcher); a process with RANK set whose parent is another rank
    (a DataLoader worker) or that was re-parented away from the launcher (the child of a rank
    that died) is not a rank."""
    ppids: dict[int, int] = {}
    for c in cands:
        try:
            ppids[c.pid] = psutil.Process(c.pid).ppid()
        except psutil.Error:
            ppids[c.pid] = -1
    def threads(pid: int) -> int:
        try:
            return psutil.Process(pid).num_threads()
        except psutil.Error:
            return 0

    cand_pids = {c.pid for c in cands}
    n_threads = {c.pid: threads(c.pid) for c in cands}
    # the launcher is the parent of the real ranks; a fork left behind by a dead rank (one
    # thread) is re-parented to init or to a subreaper, which must not win a tie against it
    voters = [c for c in cands if n_threads[c.pid] > 1] or cands
    launchers_ = [ppids[c.pid] for c in voters if ppids[c.pid] not in cand_pids]
    real = [p for p in launchers_ if p > 1]
    common = max(sorted(set(real)), key=real.count) if real else None
    ranks: dict[int, RankProc] = {}
    orphans = []
    for c in sorted(cands, key=lambda r: r.create_time):
        parent = ppids[c.pid]
        # a fork keeps one thread; a rank with a process group has its backend's threads
        lone = n_threads[c.pid] <= 1 and any(n > 1 for p, n in n_threads.items()
                                             if p != c.pid)
        reparented = common is not None and parent != common and (parent <= 1 or lone)
        if parent in cand_pids or reparented or c.rank in ranks:
            orphans.append(c)
        else:
            ranks[c.rank] = c
    return sorted(ranks.values(), key=lambda r: r.rank), orphans


def launcher_of(job: FoundJob) -> tuple[list[str], dict[str, str]]:
    """The command line of the job's launcher (its torchrun agent, else a rank) and the few
    variables of its environment that say where the job's store and its watchers are
    (``PET_*``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``), read only for that."""
    pid = job.agent if job.agent is not None else (job.ranks[0].pid if job.ranks else None)
    if pid is None:
        return [], {}
    try:
        p = psutil.Process(pid)
        cmd = p.cmdline()
        raw = p.environ()
    except (psutil.Error, OSError):
        return [], {}
    keep = {k: v for k, v in raw.items()
            if k.startswith("PET_") or k in ("SLURM_JOB_ID", "SLURM_STEP_ID")}
    return cmd, keep


# ----------------------------------------------------------------------------- watch
# (added for watch by sampling, runtime/monitor.py: the ranks of a watched command whose
# probe is not running, found exactly as diagnose finds them)


def ranks_under(pid: int) -> list[RankProc]:
    """The rank processes under ``pid`` (the watched command's tree), topmost per rank."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    return _ranks_under(root, socket.gethostname())
