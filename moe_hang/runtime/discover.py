"""Find the ranks of a running job from one PID (the launcher — torchrun's agent, mp.spawn's
parent, a srun-like script — or any rank), or every job on this host.

A rank is a process that has joined a process group, whatever started it:

- ``RANK`` in its environment (torchrun's workers: ranks from their start, as before);
- else torch's process-group threads among its threads (``/proc/PID/task/*/comm``, readable
  without ptrace): gloo's ``pt_gloo_runloop``/``gloo_tcp_loop``, NCCL's ``pt_nccl_watchdg``/
  ``pt_nccl_heartbt``, XCCL's ``pt_xccl_*``. They exist from ``init_process_group``'s return
  to ``destroy_process_group``, never in a launcher, nor in a rank's forked children (a fork
  keeps one thread), and they name no rank;
- else, only where no process around has joined yet (all still inside the rendezvous), a
  Python process whose launcher gave it a rank (``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``,
  ``PMI_RANK``: probe/launchers.py).

Its identity, most reliable first: the probe's heartbeat naming its pid (the job runs under
``watch``: rank and world from the process group itself); its launcher's variables (unless
two ranks of the job claim the same number there: one srun task per node that spawns its
ranks); else unknown here (``diagnose`` then reads the rank's own frames), and an unknown one
is keyed ``-pid`` (:mod:`moe_hang.evidence.rankid`), never given a number.

Only the allowlisted environment variables of another process are ever kept beyond this
module (probe.allowed_env: torchrun's and the launchers' rank variables, MASTER_*, TORCH_*,
NCCL_*, plus moe-hang's own probe directory); of the launcher, where the job's store is:
PET_*, SLURM_JOB_ID, SLURM_STEP_ID, read to group processes into jobs, never written.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from moe_hang.errors import MoeHangError
from moe_hang.evidence.model import Heartbeat
from moe_hang.evidence.rankid import unidentified_key
from moe_hang.probe import launchers
from moe_hang.probe.probe import ENV_DIR, allowed_env

_LAUNCHER_MARKERS = ("torch.distributed.run", "torchrun", "torch.distributed.launch",
                     "torch/distributed/run.py")
# thread names torch's process-group backends give their threads (c10::setThreadName)
JOINED_THREAD_PREFIXES = ("pt_gloo", "gloo_tcp", "pt_nccl", "pt_xccl")
# what tells two ranks' launches apart (read, never kept): same values, same job
_JOB_KEYS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "SLURM_JOB_ID",
             "SLURM_STEP_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_ANCESTORS = 4  # how far up from a non-rank (a DataLoader worker) to look for its rank


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


# ----------------------------------------------------------------------------- one process


@dataclass
class _Proc:
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


def _env_of(p: psutil.Process) -> tuple[dict[str, str] | None, tuple[str | None, ...]]:
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


def _loads_torch(pid: int) -> bool:
    """torch's library is mapped into ``pid`` (a Python process in an srun allocation that
    never imports torch is no rank-to-be)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def _read(p: psutil.Process) -> _Proc | None:
    if not _live(p):
        return None
    env, key = _env_of(p)
    try:
        ppid = p.ppid()
    except psutil.Error:
        return None
    return _Proc(p, env, key, joined_group(p.pid), ppid)


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


def _live(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
    if python and not _is_python(p):
        raise MoeHangError(f"PID {pid} ({p.name()}) is not a Python process")
    return p


# ----------------------------------------------------------------------------- identity


def _probe_ranks(dirs: set[str]) -> dict[int, Heartbeat]:
    """pid -> the latest heartbeat of the probe in that pid (the rank it learned itself)."""
    out: dict[int, Heartbeat] = {}
    for d in dirs:
        try:
            files = list(Path(d).glob("rank*.hb.json"))
        except OSError:
            continue
        for f in files:
            try:
                hb = Heartbeat.parse(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
            if hb is not None and hb.pid is not None:
                out[hb.pid] = hb
    return out


def _ct(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


def _identify(procs: list[_Proc], host: str) -> list[RankProc]:
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


# ----------------------------------------------------------------------------- a job


def _rank_procs(procs: list[_Proc]) -> list[_Proc]:
    """The ranks among ``procs`` (module docstring): RANK, else joined; where none has joined
    yet, the Python processes a launcher gave a rank. A rank's own children (DataLoader
    workers) inherit its variables: the topmost is kept."""
    ranks = [q for q in procs if q.has_rank_var or q.joined]
    if not ranks:
        ranks = [q for q in procs if q.env_identity is not None and _is_python(q.p)
                 and not _is_launcher(q.p) and _loads_torch(q.pid)]
    by_pid = {q.pid: q for q in ranks}
    out = []
    for q in ranks:
        parent = by_pid.get(q.ppid)
        if parent is not None and not q.joined and (
                parent.env_identity == q.env_identity or not q.has_rank_var):
            continue  # a child that inherited its parent's identity and joined nothing
        out.append(q)
    return out


def _ranks_under(root: psutil.Process, host: str) -> list[RankProc]:
    try:
        kids = root.children(recursive=True)
    except psutil.Error:
        kids = []
    procs = [q for k in kids if (q := _read(k)) is not None]
    found: dict[int, RankProc] = {}
    for rp in _identify(_rank_procs(procs), host):
        found.setdefault(rp.rank, rp)
    return sorted(found.values(), key=rank_order)


def rank_order(r: RankProc) -> tuple[int, int]:
    """Identified ranks by number, then the unidentified by pid."""
    return (0, r.rank) if r.identified else (1, r.pid)


def _same_job(a: RankProc, b: RankProc) -> bool:
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
    return all(a.env.get(k) == b.env.get(k) for k in keys)


def _is_rank(q: _Proc) -> bool:
    return q.has_rank_var or q.joined


def _parent(p: psutil.Process) -> psutil.Process | None:
    try:
        parent = p.parent()
    except psutil.Error:
        return None
    return parent if parent is not None and parent.pid > 1 and _live(parent) else None


def _rank_above(p: psutil.Process) -> _Proc | None:
    """The nearest ancestor that is a rank (``p`` is its DataLoader or compile worker)."""
    cur: psutil.Process | None = p
    for _ in range(_ANCESTORS):
        cur = _parent(cur) if cur is not None else None
        if cur is None:
            return None
        q = _read(cur)
        if q is not None and _is_rank(q):
            return q
    return None


def find_job(pid: int) -> FoundJob:
    """All rank processes of the job ``pid`` belongs to, on this machine."""
    p = check_target(pid, python=False)
    host = socket.gethostname()
    me = _read(p)
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
        agent = p if _is_launcher(p) else None
        return _job(pid, agent, None if agent else p.pid, under)
    if not _is_rank(me):
        if not _is_python(p):
            raise MoeHangError(f"PID {pid} ({p.name()}) is not a Python process")
        if _is_launcher(p):
            raise MoeHangError(f"PID {pid} is a torchrun agent with no live rank processes "
                               "(the job has ended or not started)")
        raise MoeHangError(f"PID {pid} is a Python process but not a torch.distributed job: "
                           "neither it nor any process under it has joined a process group "
                           "(no RANK in its environment, no process-group threads)")
    parent = _parent(me.p)
    if parent is not None and _is_launcher(parent):
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
    mine = _identify([me], host)[0]
    ranks = []
    for q in psutil.process_iter():
        r = _read(q) if q.pid != os.getpid() else None
        if r is None or not r.has_rank_var:
            continue
        rp = _identify([r], host)[0]
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
        return _env_of(psutil.Process(pid))[1]
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


# ----------------------------------------------------------------------------- the host


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
        from moe_hang.evidence.rankid import is_unidentified

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
    everyone = [q for p in psutil.process_iter() if p.pid != me and (q := _read(p)) is not None]
    procs = {q.pid: q for q in _rank_procs(everyone)}
    groups: dict[tuple[Any, ...], list[_Proc]] = {}
    agents: dict[tuple[Any, ...], psutil.Process] = {}
    parents: dict[tuple[Any, ...], psutil.Process] = {}
    for q in procs.values():
        parent: psutil.Process | None
        try:
            parent = psutil.Process(q.ppid) if q.ppid > 1 else None
        except psutil.Error:
            parent = None
        if parent is not None and _is_launcher(parent):
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
        ranks = sorted(_identify(members, host), key=rank_order)
        agent = agents.get(key)
        launcher = parents.get(key)
        if launcher is not None and not (_is_python(launcher) or len(ranks) > 1):
            launcher = None  # a shell that started one rank: that rank is the job's face
        lead = agent or launcher or procs[ranks[0].pid].p
        cmd = " ".join(_cmdline(lead)) or "?"
        jobs.append(JobOnHost(pid=lead.pid, agent=agent.pid if agent else None,
                              ranks=sorted({r.rank for r in ranks}),
                              world_size=next((r.world_size for r in ranks if r.world_size),
                                              None), command=cmd,
                              launcher=launcher.pid if launcher else None))
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
