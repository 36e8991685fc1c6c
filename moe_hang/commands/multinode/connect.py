"""How this watcher reaches the others (:class:`Plan`: the job's store or a shared directory),
opening that channel, and the other nodes' summaries for ``diagnose``."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_hang.errors import MoeHangError
from moe_hang.runtime import coord
from moe_hang.runtime.coord import (
    Channel,
    Coordinator,
    DirChannel,
    NodeSummary,
    StoreChannel,
    StoreEndpoint,
)
from moe_hang.runtime.coord.relay import RELAY_KEY, open_relay


@dataclass
class Plan:
    """How this watcher reaches the others: the job's store, or a shared directory."""

    endpoint: StoreEndpoint | None
    shared_dir: Path | None
    run: str  # the run key: moe-hang/<run>/ in the channel

    def describe(self) -> str:
        if self.shared_dir is not None:
            return f"shared directory {self.shared_dir}"
        assert self.endpoint is not None
        return f"the job's store {self.endpoint.host}:{self.endpoint.port}"


def check_shared_dir(path: str | os.PathLike[str]) -> Path:
    """``--shared-dir``: an existing directory this user can write (tried, not guessed)."""
    p = Path(path)
    if not p.is_dir():
        raise MoeHangError(f"--shared-dir {p}: not a directory (create it on a file system "
                           "every node sees)")
    try:
        fd, name = tempfile.mkstemp(prefix=".moe-hang-check-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise MoeHangError(f"--shared-dir {p}: not writable ({exc.strerror})") from None
    return p.resolve()


def plan(cmd: Sequence[str], shared_dir: str | os.PathLike[str] | None,
         env: Mapping[str, str] | None = None) -> Plan | None:
    """None for a single-node job without ``--shared-dir``: nothing to coordinate."""
    ep = coord.endpoint_from_torchrun(cmd, env)
    if shared_dir is None and (ep is None or not ep.multi_node):
        return None
    sd = check_shared_dir(shared_dir) if shared_dir is not None else None
    return Plan(ep, sd, coord.run_key(ep.run_id if ep else None, env))


def plan_from_ranks(pids: Iterable[int], env: Mapping[str, str] | None = None) -> Plan | None:
    """A job that spans nodes and was not started by torchrun (srun, mpirun, a launcher of the
    job's own): the store its ranks' ``env://`` init uses, which rank 0's process hosts
    (MASTER_ADDR:MASTER_PORT: read from a rank's environment, those two variables only, else
    from this watcher's own). Its run key comes from the port, the same on every node."""
    import psutil

    e = os.environ if env is None else env
    found: dict[str, str] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            penv = psutil.Process(pid).environ()
            found = {k: penv[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in penv}
            if len(found) == 2:
                break
    if len(found) < 2:
        found = {k: e[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in e}
    ep = coord.endpoint_from_rank_env(found)
    if ep is None:
        return None
    ep.run_id = f"env-{ep.port}"
    return Plan(ep, None, coord.run_key(ep.run_id, e))


def open_channel(p: Plan, *, connect_s: float, stop: threading.Event | None = None
                 ) -> tuple[Channel | None, str | None]:
    """(channel, None) or (None, why not)."""
    if p.shared_dir is not None:
        return DirChannel(p.shared_dir, p.run), None
    assert p.endpoint is not None
    ep = p.endpoint
    ch = StoreChannel(ep.host, ep.port, p.run)
    if ch.connect(timeout=connect_s, stop=stop):
        return ch, None
    ch.close()
    return None, (f"the job's store {ep.host}:{ep.port} is not reachable from here "
                  "(give every watcher --shared-dir DIR)")


def _agent_endpoint(pids: Iterable[int]) -> StoreEndpoint | None:
    """The store of the torchrun agent among the job's processes (the watched command may be
    a wrapper: ``ip netns exec ...``, ``bash -c ...``, a container runtime)."""
    import psutil

    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            p = psutil.Process(pid)
            ep = coord.endpoint_from_torchrun(p.cmdline(), {
                k: v for k, v in p.environ().items() if k.startswith("PET_")})
            if ep is not None:
                return ep
    return None


def peers_for_diagnose(agent_cmdline: Sequence[str], agent_env: Mapping[str, str],
                       shared_dir: str | os.PathLike[str] | None, local_ranks: Iterable[int],
                       *, fresh_s: float,
                       connect_s: float = 3.0) -> tuple[dict[str, NodeSummary], str | None]:
    """The other nodes' latest summaries, where their watchers publish them: (node ->
    summary, None) or ({}, why not). Only summaries younger than ``fresh_s``
    (``Settings.summary_fresh_s``: an older one says nothing about now); never this node's
    own ranks."""
    p = plan(agent_cmdline, shared_dir, agent_env)
    if p is None:
        return {}, None
    if p.shared_dir is None:
        coord.preload_torch()
    ch, why = open_channel(p, connect_s=connect_s)
    if ch is None:
        return {}, why
    if isinstance(ch, StoreChannel):
        # the watchers talk in their own store once they have met (coord.relay)
        with contextlib.suppress(coord.ChannelGone):
            relay = open_relay(ch.get(RELAY_KEY), p.run, connect_s=connect_s)
            if relay is not None:
                ch.close()
                ch = relay
    try:
        co = Coordinator(ch, f"diagnose-{socket.gethostname()}-{os.getpid()}")
        sums = co.read_summaries()
        if ch.gone:
            return {}, ch.gone
        mine = set(local_ranks)
        now = time.time()
        return {n: s for n, s in sums.items()
                if now - s.time <= fresh_s and not mine & {r.rank for r in s.ranks}}, None
    finally:
        ch.close()
