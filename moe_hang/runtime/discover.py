"""Find the ranks of a running job from one PID (the torchrun agent or any rank).

Only the allowlisted environment variables of another process are ever read into memory
beyond this module (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCH_*, NCCL_*,
plus moe-hang's own probe directory; of the launcher, where the job's store is: PET_*,
SLURM_JOB_ID, SLURM_STEP_ID, never written anywhere).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import psutil

from moe_hang.errors import MoeHangError
from moe_hang.probe.probe import ENV_DIR, allowed_env

_LAUNCHER_MARKERS = ("torch.distributed.run", "torchrun", "torch.distributed.launch",
                     "torch/distributed/run.py")


@dataclass
class RankProc:
    rank: int
    pid: int
    host: str
    local_rank: int | None = None
    world_size: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # allowlisted only
    probe_dir: str | None = None
    create_time: float = 0.0


@dataclass
class FoundJob:
    target: int
    agent: int | None
    ranks: list[RankProc]
    world_size: int | None
    # processes that carry a RANK but are not ranks: children a dead rank left behind
    orphans: list[RankProc] = field(default_factory=list)

    def missing_ranks(self) -> list[int]:
        if not self.world_size:
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


def _env(p: psutil.Process) -> dict[str, str] | None:
    try:
        raw = p.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return None
    env = allowed_env(raw)
    for extra in ("LOCAL_WORLD_SIZE", ENV_DIR):
        if extra in raw:
            env[extra] = raw[extra]
    return env


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.Error, OSError):
        return []


def _is_python(p: psutil.Process) -> bool:
    parts = _cmdline(p)
    try:
        names = [p.name(), os.path.basename(p.exe() or "")]
    except (psutil.Error, OSError):
        names = []
    return any("python" in (n or "").lower() for n in names + [os.path.basename(x)
                                                              for x in parts[:1]])


def _is_launcher(p: psutil.Process) -> bool:
    return any(m in part for part in _cmdline(p) for m in _LAUNCHER_MARKERS)


def check_target(pid: int) -> psutil.Process:
    """The process behind ``pid``, or a one-line :class:`MoeHangError` saying why not."""
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
    if not _is_python(p):
        raise MoeHangError(f"PID {pid} ({p.name()}) is not a Python process")
    return p


def _rank_of(p: psutil.Process, host: str) -> RankProc | None:
    env = _env(p)
    if not env or "RANK" not in env:
        return None
    try:
        rank = int(env["RANK"])
    except ValueError:
        return None

    def num(key: str) -> int | None:
        try:
            return int(env[key]) if key in env else None
        except ValueError:
            return None

    try:
        ct = p.create_time()
    except psutil.Error:
        ct = 0.0
    return RankProc(rank=rank, pid=p.pid, host=host, local_rank=num("LOCAL_RANK"),
                    world_size=num("WORLD_SIZE"), env=env, probe_dir=env.get(ENV_DIR),
                    create_time=ct)


def _live(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ranks_under(root: psutil.Process, host: str) -> list[RankProc]:
    found: dict[int, RankProc] = {}
    try:
        kids = root.children(recursive=True)
    except psutil.Error:
        kids = []
    # each process's environment is read once; a process gone mid-scan is simply not a rank
    ranks = {k.pid: rp for k in kids if _live(k) and (rp := _rank_of(k, host)) is not None}
    for k in kids:
        rp = ranks.get(k.pid)
        if rp is None:
            continue
        # a rank's own children (DataLoader workers) inherit RANK: keep the topmost
        try:
            parent = ranks.get(k.ppid())
        except psutil.Error:
            parent = None
        if parent is not None and parent.rank == rp.rank:
            continue
        found.setdefault(rp.rank, rp)
    return sorted(found.values(), key=lambda r: r.rank)


def _same_job(a: RankProc, b: RankProc) -> bool:
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
    return all(a.env.get(k) == b.env.get(k) for k in keys)


def find_job(pid: int) -> FoundJob:
    """All rank processes of the job ``pid`` belongs to, on this machine."""
    p = check_target(pid)
    host = socket.gethostname()
    me = _rank_of(p, host)
    if me is None and _env(p) is None:
        raise MoeHangError(f"PID {pid}: cannot read its environment: no ptrace permission",
                           hint="run as root, add CAP_SYS_PTRACE, or set "
                                "kernel.yama.ptrace_scope=0")
    agent: psutil.Process | None = None
    orphans: list[RankProc] = []
    if me is not None:
        try:
            parent = p.parent()
        except psutil.Error:
            parent = None
        if parent is not None and _is_launcher(parent):
            agent = parent
    under: list[RankProc] = []
    if me is None:  # the agent itself, or some launcher above the ranks: one walk of its tree
        under = _ranks_under(p, host)
        if under or _is_launcher(p):
            agent = p
    if agent is not None:
        ranks = under or _ranks_under(agent, host)
    elif me is not None:
        # launched without torchrun (mpirun, srun, a script): match by rendezvous settings
        ranks = []
        for q in psutil.process_iter():
            if not _live(q):
                continue
            rp = _rank_of(q, host)
            if rp is not None and _same_job(rp, me):
                ranks.append(rp)
        ranks, orphans = _split_orphans(ranks)
    else:
        raise MoeHangError(f"PID {pid} is a Python process but not a torch.distributed job "
                           "(no RANK in its environment and no torchrun workers under it)")
    if not ranks:
        raise MoeHangError(f"PID {pid} is a torchrun agent with no live rank processes "
                           "(the job has ended or not started)")
    world = next((r.world_size for r in ranks if r.world_size), None)
    return FoundJob(target=pid, agent=agent.pid if agent else None, ranks=ranks, world_size=world,
               orphans=orphans)


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
    launchers = [ppids[c.pid] for c in voters if ppids[c.pid] not in cand_pids]
    real = [p for p in launchers if p > 1]
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


@dataclass
class JobOnHost:
    """One distributed job found on this host (``moe-hang diagnose`` without a PID)."""

    pid: int  # what to diagnose: its torchrun agent, else its lowest rank
    agent: int | None
    ranks: list[int]
    world_size: int | None
    command: str

    def describe(self) -> str:
        what = "torchrun agent" if self.agent is not None else f"rank {min(self.ranks)}"
        rs = self.ranks
        span = (f"rank {rs[0]}" if len(rs) == 1 else
                f"ranks {rs[0]}-{rs[-1]}" if rs == list(range(rs[0], rs[-1] + 1)) else
                "ranks " + ",".join(map(str, rs)))
        of = f" of {self.world_size}" if self.world_size else ""
        return f"PID {self.pid}  {what}, {span}{of}: {self.command[:90]}"


def find_jobs() -> list[JobOnHost]:
    """Every distributed job on this host that this user may read: processes with RANK in
    their environment, grouped by their torchrun agent (their parent), else by rendezvous
    settings (ranks started by srun or mpirun). A rank's own children (DataLoader workers)
    are not ranks."""
    host = socket.gethostname()
    me = os.getpid()
    procs: dict[int, tuple[psutil.Process, RankProc]] = {}
    for p in psutil.process_iter():
        if p.pid == me or not _live(p):
            continue
        rp = _rank_of(p, host)
        if rp is not None:
            procs[p.pid] = (p, rp)
    groups: dict[tuple[Any, ...], list[RankProc]] = {}
    agents: dict[tuple[Any, ...], psutil.Process] = {}
    for p, rp in procs.values():
        try:
            ppid = p.ppid()
        except psutil.Error:
            continue
        parent_rank = procs.get(ppid)
        if parent_rank is not None and parent_rank[1].rank == rp.rank:
            continue
        parent: psutil.Process | None
        try:
            parent = psutil.Process(ppid) if ppid > 1 else None
        except psutil.Error:
            parent = None
        if parent is not None and _is_launcher(parent):
            key: tuple[Any, ...] = ("agent", ppid)
            agents[key] = parent
        else:
            key = ("env", *(rp.env.get(k) for k in ("MASTER_ADDR", "MASTER_PORT",
                                                   "TORCHELASTIC_RUN_ID", "WORLD_SIZE")))
        groups.setdefault(key, []).append(rp)
    jobs = []
    for key, ranks in groups.items():
        ranks.sort(key=lambda r: r.rank)
        agent = agents.get(key)
        lead = agent if agent is not None else procs[ranks[0].pid][0]
        cmd = " ".join(_cmdline(lead)) or "?"
        jobs.append(JobOnHost(pid=lead.pid, agent=agent.pid if agent else None,
                              ranks=sorted({r.rank for r in ranks}),
                              world_size=next((r.world_size for r in ranks if r.world_size),
                                              None), command=cmd))
    return sorted(jobs, key=lambda j: j.pid)


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
