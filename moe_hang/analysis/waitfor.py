"""Who waits for whom: the wait-for graph across groups and point-to-point calls, and its
cycles (docs/DESIGN.md §8). Pure.

An edge ``u -> v`` says rank u is blocked in something only rank v can complete: a collective
of a group v belongs to and has not posted yet, or a recv from v (a send to v) that v has not
matched. A cycle can never resolve by itself: it is a deadlock, whoever is to blame.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.align import GroupDivergence
from moe_hang.analysis.diagnosis import MismatchKind, pg_label
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.evidence.calls import P2PCall
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.vocab import RankState


@dataclass(frozen=True)
class Edge:
    waiter: int
    on: int
    what: str  # for a person: "all_reduce default_pg#7", "recv from rank 0"
    coll: Collective | None = None  # the collective waited in (None for point-to-point)
    p2p: P2PCall | None = None
    stream: bool = False  # from posting order alone (NCCL: X pending behind another group's)


def _p2p_of(v: RankView) -> P2PCall | None:
    if v.state != RankState.IN_COLLECTIVE or v.ev.progressed is not False:
        return None
    if v.stack.p2p is not None:
        return v.stack.p2p
    hb = v.ev.heartbeat
    if hb is not None and hb.p2p is not None and v.stack.op in (None, hb.p2p.op):
        return hb.p2p
    return None


def _matches(a: P2PCall, a_rank: int, b: P2PCall | None, b_rank: int) -> bool:
    """b is the other end of a's call (a recv from b while b sends to a, or vice versa)."""
    return (b is not None and {a.op, b.op} == {"send", "recv"} and a.peer == b_rank
            and b.peer in (a_rank, None) and a.tag == b.tag)


def edges(views: RankViews, divs: list[GroupDivergence]) -> list[Edge]:
    out: list[Edge] = []
    for g in divs:
        if g.div.kind != MismatchKind.MISSING or not g.absent:
            continue
        label = (f"{next(iter(g.have.values())).op} "
                 f"{pg_label(g.div.pg, g.div.pg_desc, word='group')}#{g.div.seq}")
        for w, c in g.have.items():
            if c.completed is True or views[w].state == RankState.EXITED:
                continue
            out.extend(Edge(w, a, label, coll=c) for a in g.absent
                       if views[a].state != RankState.EXITED)
    out.extend(_stream_edges(views))
    for r, v in views.items():
        call = _p2p_of(v)
        if call is None or call.peer is None or call.peer not in views:
            continue
        if not _matches(call, r, _p2p_of(views[call.peer]), call.peer):
            out.append(Edge(r, call.peer, call.describe(), p2p=call))
    return out


def _head(v: RankView) -> tuple[Collective | None, set[tuple[str, int]]]:
    """The rank's oldest pending collective in posting order (record ids), and every pending
    one's (group, seq)."""
    if v.ev.fr is None or v.ev.progressed is not False or v.state != RankState.IN_COLLECTIVE:
        return None, set()
    pend = [c for c in v.ev.fr.entries if c.completed is False and c.record_id is not None]
    if not pend:
        return None, set()
    return min(pend, key=lambda c: c.record_id or 0), {(c.pg, c.seq) for c in pend}


def _stream_edges(views: RankViews) -> list[Edge]:
    """On NCCL a rank enqueues collectives without waiting: several are pending at once, and
    its oldest holds the rest. A rank whose oldest is X waits for a member of X's group that
    has X pending behind something else of its own (the two posted in different orders).
    The candidates are found through what each rank has pending, not by walking every
    member of X's group (8192 ranks in one group: 67 million pairs)."""
    heads = {r: _head(v) for r, v in views.items()}
    # (m's oldest Y, an X m has pending) -> every such m
    holding: dict[tuple[tuple[str, int], tuple[str, int]], list[int]] = {}
    for m, (mh, pending) in heads.items():
        if mh is not None:
            for x in pending:
                if x[0] != mh.pg:
                    holding.setdefault(((mh.pg, mh.seq), x), []).append(m)
    member_sets: dict[int, frozenset[int]] = {}  # one load shares each group's member list
    out: list[Edge] = []
    for r, (head, mine) in heads.items():
        if head is None:
            continue
        fr = views[r].ev.fr
        members = fr.pg_ranks.get(head.pg, ()) if fr is not None else ()
        group = member_sets.get(id(members))
        if group is None:
            group = member_sets[id(members)] = frozenset(members)
        key = (head.pg, head.seq)
        # m holds X behind its own oldest Y, of another group, which r has pending behind
        # X: the two posted X and Y in opposite orders (anything else resolves in turn)
        found = sorted({m for y in mine if y[0] != head.pg for m in holding.get((y, key), ())
                        if m != r and m in group})
        label = f"{head.op} {pg_label(head.pg, head.pg_desc, word='group')}#{head.seq}"
        out.extend(Edge(r, m, label, coll=head, stream=True) for m in found)
    return out


def cycles(es: list[Edge]) -> list[list[Edge]]:
    """Elementary cycles of the graph, each once (as the edges around it, smallest rank
    first), shortest first."""
    by_waiter: dict[int, list[Edge]] = {}
    for e in es:
        by_waiter.setdefault(e.waiter, []).append(e)
    found: dict[frozenset[tuple[int, int]], list[Edge]] = {}

    budget = [200_000]  # steps: on thousands of ranks the search stops, never the tool

    def walk(start: int, node: int, path: list[Edge], seen: set[int]) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            return
        for e in by_waiter.get(node, []):
            if e.on == start:
                cyc = [*path, e]
                key = frozenset((x.waiter, x.on) for x in cyc)
                found.setdefault(key, cyc)
            elif e.on not in seen and e.on > start and len(path) < 16:
                walk(start, e.on, [*path, e], seen | {e.on})

    for start in sorted(by_waiter):
        walk(start, start, [], {start})
    return sorted(found.values(), key=lambda c: (len(c), min(e.waiter for e in c)))
