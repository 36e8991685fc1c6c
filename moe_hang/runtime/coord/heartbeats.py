"""Node summaries from the ranks' probe heartbeats, heartbeats back from summaries, and the
job's nodes as torchrun numbers them."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from moe_hang.evidence.vocab import RankState
from moe_hang.runtime.coord.codec import _int_or_none
from moe_hang.runtime.coord.summary import NodeSummary, PendingCollective, RankSummary, p2p_of

# frames that are never the user's line (kept in step with moe_hang.stacks.is_library_frame)
_TOOL_FILES = ("moe_hang/probe/", "moe_hang/probe.py", "moe_hang/_probe_site/")


def _is_library(path: str) -> bool:
    p = path.replace("\\", "/")
    return ("/torch/" in p or p.startswith("torch/") or p.endswith("typing_extensions.py")
            or p.startswith("<frozen") or p.endswith(("/runpy.py", "/threading.py"))
            or any(t in p for t in _TOOL_FILES))


def _frames(raw: Any) -> list[tuple[str, int, str]]:
    out = []
    for f in raw or []:
        if isinstance(f, Mapping):
            out.append((str(f.get("filename", f.get("file", "?"))), int(f.get("line", 0) or 0),
                        str(f.get("name", f.get("function", "?")))))
        elif isinstance(f, (list, tuple)) and len(f) >= 3:
            out.append((str(f[0]), int(f[1] or 0), str(f[2])))
    return out


def _site(frames: list[tuple[str, int, str]]) -> str | None:
    for file, line, fn in frames:
        if not _is_library(file):
            return f"{file}:{line}:{fn}"
    return None


def parse_frame(s: str) -> list[Any]:
    """``file:line:function`` back into [file, line, function] (a path may hold ':')."""
    return _parse_frame(s)


def _parse_frame(s: str) -> list[Any]:
    file, _, rest = s.rpartition(":")  # file:line:function (a path may hold ':')
    file2, _, line = file.rpartition(":")
    if not file2:
        return [s, 0, "?"]
    return [file2, int(line) if line.isdigit() else 0, rest]


def summarize_heartbeats(hbs: Mapping[int, Mapping[str, Any]], *, node: str,
                         host: str | None = None,
                         moving: Mapping[int, bool] | None = None,
                         alive: Mapping[int, bool] | None = None,
                         exit_codes: Mapping[int, int | None] | None = None,
                         kind: str = "periodic", max_frames: int = 24,
                         now: float | None = None) -> NodeSummary:
    """A node's summary from its ranks' probe heartbeats (``ranks/rank*.hb.json``).

    ``moving``: whether the watcher saw each rank move lately (fingerprint or CPU); ``alive``
    and ``exit_codes`` from its process table."""
    ranks: list[RankSummary] = []
    world = local_world = None
    for r in sorted(hbs):
        hb = hbs[r]
        world = world or _int_or_none(hb.get("world"))
        local_world = local_world or _int_or_none(hb.get("local_world"))
        raw_progress = hb.get("progress")
        progress: Mapping[str, Any] = raw_progress if isinstance(raw_progress, Mapping) else {}
        pending = [p for p in (PendingCollective.from_fr_entry(e) for e in hb.get("pending") or []
                               if isinstance(e, Mapping)) if p is not None]
        pending.sort(key=lambda p: (p.t_ns or 0, p.seq))
        enq: dict[str, int] = {}
        done: dict[str, int] = {}
        for pg, st in (hb.get("pg_status") or {}).items():
            if isinstance(st, Mapping):
                e, c = _int_or_none(st.get("enqueued")), _int_or_none(st.get("completed"))
                if e is not None:
                    enq[str(pg)] = e
                if c is not None:
                    done[str(pg)] = c
        main = _frames(hb.get("main_frame"))
        fr_frames: list[tuple[str, int, str]] = []
        for e in hb.get("pending") or []:
            if isinstance(e, Mapping) and e.get("frames"):
                fr_frames = _frames(e.get("frames"))
                break
        site = _site(fr_frames) or _site(main)
        is_alive = None if alive is None else alive.get(r)
        code = None if exit_codes is None else exit_codes.get(r)
        mv = None if moving is None else moving.get(r)
        waiting = bool(pending) or any(enq.get(pg, -1) > c for pg, c in done.items())
        if is_alive is False or code is not None or progress.get("phase") == "exiting":
            state = RankState.EXITED
        elif waiting and not mv:
            state = RankState.IN_COLLECTIVE
        elif mv is None:
            state = RankState.UNKNOWN  # alive, outside collectives, movement not measured
        else:
            state = RankState.COMPUTING if mv else RankState.IDLE
        ranks.append(RankSummary(
            rank=int(r), pid=_int_or_none(hb.get("pid")),
            local_rank=_int_or_none(hb.get("local_rank")),
            state=state, pending=pending, enqueued=enq, completed=done, callsite=site,
            stack=[f"{f}:{ln}:{fn}" for f, ln, fn in main[:max_frames]],
            step=_int_or_none(progress.get("step")),
            phase=None if progress.get("phase") is None else str(progress.get("phase")),
            moving=mv,
            beat_time=hb.get("time") if isinstance(hb.get("time"), (int, float)) else None,
            exit_code=code, held=hb.get("held") is True, p2p=p2p_of(hb.get("p2p")),
            main_thread=str(hb["main_thread"])[:40] if hb.get("main_thread") else None))
    h = host or next((str(hb["host"]) for hb in hbs.values() if hb.get("host")),
                     socket.gethostname())
    return NodeSummary(node=node, host=h, ranks=ranks, world=world, local_world=local_world,
                       time=time.time() if now is None else now, watcher_pid=os.getpid(), kind=kind)


def to_heartbeats(summaries: Iterable[NodeSummary]) -> dict[int, dict[str, Any]]:
    """Heartbeat-shaped records (the probe's format) for every rank of the given summaries,
    global rank -> record: what ``moe_hang.analysis`` reads (``quick_divergence``, or
    ``RankEvidence.heartbeat``) when a remote rank has no richer evidence."""
    out: dict[int, dict[str, Any]] = {}
    for s in summaries:
        for r in s.ranks:
            pg_status = {pg: {"enqueued": r.enqueued.get(pg, -1), "completed": c}
                         for pg, c in r.completed.items()}
            for pg, e in r.enqueued.items():
                pg_status.setdefault(pg, {"enqueued": e, "completed": -1})
            progress: dict[str, Any] = {}
            if r.step is not None:
                progress["step"] = r.step
            if r.phase is not None:
                progress["phase"] = r.phase
            out[r.rank] = {
                "rank": r.rank, "pid": r.pid, "host": s.host, "node": s.node, "world": s.world,
                "local_rank": r.local_rank, "local_world": s.local_world, "time": r.beat_time,
                "progress": progress, "pg_status": pg_status,
                "pending": [p.to_fr_entry() for p in r.pending],
                "main_frame": [_parse_frame(f) for f in r.stack] or None,
                "main_thread": r.main_thread,
                "state": r.state, "callsite": r.callsite, "held": r.held, "p2p": r.p2p}
    return out


def expected_nodes(world: int | None, local_world: int | None,
                   group_world: int | None = None) -> list[str]:
    """Node ids "0".."N-1" (torchrun's group ranks): GROUP_WORLD_SIZE, else
    WORLD_SIZE / LOCAL_WORLD_SIZE (every node runs as many ranks)."""
    n = group_world
    if n is None and world and local_world:
        n = -(-int(world) // int(local_world))
    return [str(i) for i in range(n or 0)]


def node_id_from_heartbeats(hbs: Mapping[int, Mapping[str, Any]]) -> str | None:
    """torchrun's group rank of this node, from its ranks: global ranks are handed out in
    group-rank order, LOCAL_WORLD_SIZE at a time."""
    for r, hb in sorted(hbs.items()):
        lr, lw = _int_or_none(hb.get("local_rank")), _int_or_none(hb.get("local_world"))
        if lr is not None and lw:
            return str((int(r) - lr) // lw)
    return None


def ranks_of_nodes(nodes: Iterable[str], local_world: int | None) -> list[int]:
    out: list[int] = []
    if not local_world:
        return out
    for n in nodes:
        if n.isdigit():
            out.extend(range(int(n) * local_world, (int(n) + 1) * local_world))
    return sorted(out)


def remote_moving(summaries: Mapping[str, NodeSummary], me: str, *, now: float | None = None,
                  fresh_s: float = 10.0) -> list[int]:
    """Ranks on other nodes whose watcher saw them move in a recent summary: while there are
    some, a local stall is a straggler somewhere else, not a global hang."""
    t = time.time() if now is None else now
    return sorted(r.rank for n, s in summaries.items() if n != me and t - s.time <= fresh_s
                  for r in s.ranks if r.moving)
