"""Which global rank each communicator rank of a RAS report is, from what the tool knows of the
job's processes — pure; never guessed (:func:`infer_global_ranks`).

RAS names a process by the IP address of its RAS socket and its pid; the tool knows ranks by
host *name* and pid (``processes.json``, heartbeats). In order:

1. ``aliases`` the caller measured (this machine's addresses -> its name);
2. an address whose pids are all ranks of exactly one known host, and of no other, is that
   host (a pid alone repeats across nodes, in containers often: then nothing is inferred);
3. (host, pid) -> global rank, for every communicator;
4. when no process of the report is known at all: torch numbers a group that holds every rank
   by global rank (``new_group`` sorts its ranks; the default group is the world), so the one
   communicator that holds every process RAS reached — of the job's world size, when known —
   gives global ranks, and through its processes every other communicator's.

What none of these reaches stays unmapped: the communicator's own rank is said instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moe_hang.evidence.ras.ranks import ProcessKey, comm_global_ranks
from moe_hang.evidence.ras.records import RasCommunicator, RasReport

BY_PROCESS = "host and pid"
BY_WORLD = "the numbering of the communicator that holds every process"


def _members(c: RasCommunicator) -> list[tuple[int, str, int]]:
    """(comm rank, host, pid) of its live and missing ranks."""
    return [(r.rank, r.host, r.pid) for r in c.ranks] + \
        [(m.rank, m.host, m.pid) for m in c.missing_ranks]


def host_aliases(reports: Sequence[RasReport], known: Mapping[ProcessKey, int],
                 given: Mapping[str, str] | None = None) -> dict[str, str]:
    """RAS address -> known host name: the ``given`` ones, and each address whose known pids
    all live on one known host (and that host answers no other address)."""
    out = dict(given or {})
    known_hosts = {h for h, _ in known}
    pids_of: dict[str, set[int]] = {}
    for rep in reports:
        for c in rep.communicators:
            for _, host, pid in _members(c):
                if pid >= 0:
                    pids_of.setdefault(host, set()).add(pid)
    claimed: dict[str, list[str]] = {}
    for addr, pids in pids_of.items():
        if addr in out or addr in known_hosts:
            continue
        # the known hosts any of this address's pids lives on: one, or it is not inferred
        hosts = {h for h, p in known if p in pids}
        if len(hosts) == 1:
            claimed.setdefault(hosts.pop(), []).append(addr)
    for h, addrs in claimed.items():
        if len(addrs) == 1:
            out[addrs[0]] = h
    return out


def _world(reports: Sequence[RasReport], world_size: int | None) -> RasCommunicator | None:
    """The communicator that holds every process of the latest report (all its members
    present, live or missing), of the job's world size where known; None unless unique."""
    rep = reports[-1]
    procs = {(h, p) for c in rep.communicators for _, h, p in _members(c) if p >= 0}
    found = []
    for c in rep.communicators:
        members = _members(c)
        if c.size <= 0 or len(members) != c.size:
            continue
        if world_size is not None and c.size != world_size:
            continue
        if {(h, p) for _, h, p in members if p >= 0} >= procs:
            found.append(c)
    # several communicators of every process (two groups of the whole world) number alike
    return found[0] if found and len({c.size for c in found}) == 1 else None


def infer_global_ranks(reports: Sequence[RasReport], known: Mapping[ProcessKey, int], *,
                       aliases: Mapping[str, str] | None = None, world_size: int | None = None
                       ) -> tuple[dict[str, dict[int, int]], str, dict[str, str]]:
    """(per communicator key: comm rank -> global rank, how they were mapped — one of
    :data:`BY_PROCESS`, :data:`BY_WORLD`, or "" when nothing could be — and the address
    aliases used)."""
    if not reports:
        return {}, "", {}
    names = host_aliases(reports, known, aliases) if known else dict(aliases or {})
    maps: dict[str, dict[int, int]] = {}
    for rep in reports:
        for c in rep.communicators:
            got = comm_global_ranks(c, known, aliases=names) if known else {}
            maps.setdefault(c.key, {}).update(got)
    if any(maps.values()):
        return maps, BY_PROCESS, names
    if known:
        return maps, "", names  # the job's processes are known and none is RAS's: no guess
    world = _world(reports, world_size)
    if world is None:
        return maps, "", names
    by_proc = {(h, p): r for r, h, p in _members(world) if p >= 0}
    for rep in reports:
        for c in rep.communicators:
            m = {r: r for r, _, _ in _members(c)} if c.key == world.key else \
                comm_global_ranks(c, by_proc)
            maps.setdefault(c.key, {}).update(m)
    return maps, BY_WORLD, names
