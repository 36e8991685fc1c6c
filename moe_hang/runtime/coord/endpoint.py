"""Where the job's store is: from torchrun's command line, or a rank's environment; and which
of the node's processes hosts it."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_hang.runtime.coord.codec import _int_or_none


@dataclass
class StoreEndpoint:
    """Where a job's store is, as its launcher was told."""

    host: str
    port: int
    run_id: str
    backend: str  # c10d | static | env
    nnodes_min: int = 1
    nnodes_max: int = 1
    node_rank: int | None = None  # static rendezvous only
    source: str = "torchrun"

    @property
    def multi_node(self) -> bool:
        return self.nnodes_max > 1


_TORCHRUN_FLAGS = {"standalone", "m", "module", "no_python", "run_path", "virtual_local_rank",
                   "h", "help"}
_TORCHRUN_VALUES = {"nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                    "rdzv_conf", "max_restarts", "monitor_interval", "start_method",
                    "event_log_handler", "role", "log_dir", "r", "redirects", "t", "tee",
                    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters",
                    "node_rank", "master_addr", "master_port", "local_addr", "logs_specs",
                    "numa_binding", "signals_to_handle", "shutdown_timeout"}


def _torchrun_args(argv: Sequence[str]) -> list[str] | None:
    for i, a in enumerate(argv):
        base = os.path.basename(a)
        if base == "torchrun":
            return list(argv[i + 1:])
        if a in ("torch.distributed.run", "torch.distributed.launch") and i and argv[i - 1] == "-m":
            return list(argv[i + 1:])
    return None


def _host_port(endpoint: str, default_port: int) -> tuple[str, int]:
    ep = endpoint.strip()
    m = re.match(r"^\[([^\]]+)\](?::(\d+))?$", ep)  # [v6]:port
    if m:
        return m.group(1), int(m.group(2) or default_port)
    host, sep, port = ep.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host or "localhost", int(port)
    return ep, default_port


def _torchrun_opts(argv: Sequence[str]) -> tuple[dict[str, str], set[str]] | None:
    """torchrun's own options (name with ``_`` -> value) and flags, up to the script."""
    args = _torchrun_args(argv)
    if args is None:
        return None
    opts: dict[str, str] = {}
    flags: set[str] = set()
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a == "-":
            break
        name, eq, val = a.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name in _TORCHRUN_VALUES:
            if not eq:
                i += 1
                val = args[i] if i < len(args) else ""
            opts[name] = val
        elif name in _TORCHRUN_FLAGS:
            flags.add(name)
        i += 1
    return opts, flags


def launches_torchrun(argv: Sequence[str]) -> bool:
    """The command is torchrun itself (``torchrun ...``, ``python -m torch.distributed.run``):
    its command line says whether the job spans nodes."""
    return _torchrun_args(argv) is not None


def torchrun_max_restarts(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """``--max-restarts`` of a torchrun command line (``PET_MAX_RESTARTS``; 0 by default, and
    for any other command)."""
    parsed = _torchrun_opts(argv)
    if parsed is None:
        return 0
    e = os.environ if env is None else env
    v = parsed[0].get("max_restarts") or e.get("PET_MAX_RESTARTS") or "0"
    return int(v) if v.isdigit() else 0


def endpoint_from_torchrun(argv: Sequence[str],
                           env: Mapping[str, str] | None = None) -> StoreEndpoint | None:
    """The store of a job started as ``torchrun ...`` / ``python -m torch.distributed.run ...``
    (also behind ``srun``): the rendezvous endpoint for ``--rdzv-backend c10d``,
    ``--master-addr:--master-port`` for static rendezvous; ``PET_*`` variables fill in flags
    not given. None when there is no TCPStore to use (not torchrun, ``--standalone``, etcd)."""
    parsed = _torchrun_opts(argv)
    if parsed is None:
        return None
    e = os.environ if env is None else env
    opts, flags = parsed

    def opt(name: str, default: str | None = None) -> str | None:
        return opts.get(name) or e.get(f"PET_{name.upper()}") or default

    if "standalone" in flags or e.get("PET_STANDALONE"):
        return None
    nnodes = opt("nnodes", "1") or "1"
    lo, _, hi = nnodes.partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        nmin = nmax = 1
    backend = (opt("rdzv_backend", "static") or "static").lower()
    run_id = opt("rdzv_id", "none") or "none"
    endpoint = opt("rdzv_endpoint", "") or ""
    if backend == "c10d":
        if not endpoint:
            return None
        host, port = _host_port(endpoint, 29400)
        return StoreEndpoint(host, port, run_id, "c10d", nmin, nmax)
    if backend == "static":
        if endpoint:
            host, port = _host_port(endpoint, 29500)
        else:
            host = opt("master_addr", "127.0.0.1") or "127.0.0.1"
            mp = opt("master_port")
            if mp is None and nmax == 1:
                return None  # torchrun turns this into a private c10d store on localhost:0
            port = int(mp or 29500)
        return StoreEndpoint(host, port, run_id, "static", nmin, nmax,
                             node_rank=_int_or_none(opt("node_rank", "0")))
    return None


def endpoint_from_rank_env(env: Mapping[str, str]) -> StoreEndpoint | None:
    """The store a rank's ``env://`` init uses (MASTER_ADDR:MASTER_PORT). Under torchrun with
    c10d that is a second store, on group rank 0's agent; with
    ``TORCHELASTIC_USE_AGENT_STORE=False`` (or without torchrun) rank 0's own process hosts it,
    so it lives only as long as rank 0 and only after ``init_process_group``."""
    addr, port = env.get("MASTER_ADDR"), _int_or_none(env.get("MASTER_PORT"))
    if not addr or port is None:
        return None
    world, lw = _int_or_none(env.get("WORLD_SIZE")), _int_or_none(env.get("LOCAL_WORLD_SIZE"))
    gw = _int_or_none(env.get("GROUP_WORLD_SIZE"))
    n = gw or (-(-world // lw) if world and lw else 1)
    return StoreEndpoint(addr, port, env.get("TORCHELASTIC_RUN_ID") or "none", "env", n, n,
                         source="rank env")


def _listen_inodes(pid: int, port: int) -> set[str]:
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def store_listener_pid(port: int, pids: Iterable[int]) -> int | None:
    """Which of ``pids`` (this node's job: the torchrun agent and its descendants) listens on
    ``port``: the node hosting the store, whose watcher must end its job last. Reads /proc
    (each process's own network namespace); None if none of them does."""
    pids = list(pids)
    wanted: set[str] = set()
    for pid in pids[:1] or []:
        wanted |= _listen_inodes(pid, port)
    if not wanted:
        for pid in pids[1:]:
            wanted |= _listen_inodes(pid, port)
    if not wanted:
        return None
    targets = {f"socket:[{i}]" for i in wanted}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return pid
    return None
