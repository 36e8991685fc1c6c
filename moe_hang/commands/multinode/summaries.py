"""What a node publishes of its capture (:func:`capture_summary`), and the other nodes'
captures and summaries back as evidence beside this node's own (:func:`merge_remote`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from moe_hang.capture import bundle
from moe_hang.evidence.flight_recorder import DEFAULT_PG
from moe_hang.evidence.flight_recorder.parse_entry import RankLists
from moe_hang.evidence.load import load_capture, merge_into, rank_numbers
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.vocab import RankState
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import coord
from moe_hang.runtime.coord import NodeSummary


def raw_heartbeats(layout: RunLayout) -> dict[int, dict[str, Any]]:
    """The ranks' heartbeats as the probe wrote them (what summaries are made of)."""
    out: dict[int, dict[str, Any]] = {}
    for p in layout.files_of(RankFiles.HEARTBEAT):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
    return out


def capture_summary(layout: RunLayout, node: str, host: str | None, *,
                    moving: Mapping[int, bool] | None,
                    alive: Mapping[int, bool] | None) -> NodeSummary:
    """What a node publishes of its capture: its ranks' heartbeats (what every node reads of
    another's ranks between rounds), and the capture itself, its run directory's own files
    (:mod:`moe_hang.capture.bundle`), read on the analysing node as this node reads them."""
    s = coord.summarize_heartbeats(raw_heartbeats(layout), node=node, host=host,
                                   moving=moving, alive=alive, kind="capture")
    ranks = sorted({r.rank for r in s.ranks} | set(rank_numbers(layout)))
    s.capture = bundle.pack(layout, ranks)
    return s


def merge_remote(ev: Evidence, summaries: Mapping[str, NodeSummary],
                 into: Path | None = None) -> list[int]:
    """The ranks of other nodes as evidence beside this node's own (a rank with evidence of
    its own is kept): a node's capture, written out under ``into`` (``into/<node>/``) and read
    as this node's own; a node's heartbeats only, where it sent no capture (a periodic
    summary: ``diagnose`` of a job watched elsewhere, a node whose job finished). Returns the
    ranks added."""
    added: list[int] = []
    lists = RankLists()  # every node's dumps name the same groups
    written = _write_captures(summaries, into, ev.world_size)
    for node, s in sorted(summaries.items()):
        part = _capture_of(node, written.get(node), ev, lists)
        if part is None:
            added += _from_heartbeats(ev, s)
            continue
        # the ranks the node beats for (its summary's): a node speaks for its own ranks only
        mine = merge_into(ev, part, {r.rank for r in s.ranks} or None)
        for r, names in bundle.left_out(s.capture).items():
            if r in mine:
                ev.ranks[r].notes.append("left out of its node's capture (past its size "
                                         f"budget): {', '.join(names)}")
        added += mine
    return sorted(added)


def _write_captures(summaries: Mapping[str, NodeSummary], into: Path | None,
                    world: int | None) -> dict[str, RunLayout | None]:
    """Each node's capture written out under ``into`` (``into/<node>/``), by node; a node
    that sent none is absent. In threads: at 128 nodes that is some 2,000 files, and each
    waits on the disk (a file's open is most of its cost here), not on Python."""
    todo = {node: (dest, s.capture) for node, s in summaries.items()
            if into is not None and s.capture
            and (dest := bundle.node_dir(into, node)) is not None}
    if not todo:
        return {}

    def write(node: str) -> tuple[str, RunLayout | None]:
        dest, data = todo[node]
        return node, bundle.unpack(data, dest, world)

    with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
        return dict(pool.map(write, sorted(todo)))


def _capture_of(node: str, layout: RunLayout | None, ev: Evidence,
                lists: RankLists) -> Evidence | None:
    """Node ``node``'s capture as written out, read; None where it sent none or it cannot be
    read (its files are another node's input: never the end of the round, and said)."""
    if layout is None:
        return None
    try:
        return load_capture(layout.root, world=ev.world_size, job=ev.job, lists=lists)
    except Exception as exc:
        ev.log_lines.append(f"node {node}: its capture is unreadable here "
                            f"({type(exc).__name__}): its ranks from their heartbeats only")
        return None


def _from_heartbeats(ev: Evidence, s: NodeSummary) -> list[int]:
    added = []
    hbs = coord.to_heartbeats([s])
    for r in s.ranks:
        if r.rank in ev.ranks:
            continue
        hb = Heartbeat.parse(hbs[r.rank])
        if hb is not None and hb.pg_status is not None:
            # a group is named by id in a heartbeat; only its pending entries (and the
            # default group, id 0 = name 0) say which name: an id of unknown name could
            # read as another group of the same number on this node
            named = {str(e.get("pg_id")) for e in hb.pending} | {DEFAULT_PG}
            hb.pg_status = {k: v for k, v in hb.pg_status.items() if k in named}
        ev.ranks[r.rank] = RankEvidence(
            rank=r.rank, pid=r.pid, host=s.host, alive=r.state != RankState.EXITED,
            exit_code=r.exit_code, heartbeat=hb, progressed=r.moving,
            groups={k: list(v) for k, v in s.groups.items()} or None)
        added.append(r.rank)
    return added
