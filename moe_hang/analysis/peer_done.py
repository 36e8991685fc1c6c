"""A collective a rank's own records leave pending that its peers' records show done (pure).

gloo's recorder leaves an ``async_op=True`` collective "scheduled" until the rank waits on
it, and a rank that dies (gloo's abort, the launcher's SIGTERM) before that wait keeps it
pending for good; NCCL's marks completion only when its watchdog looks. Such a rank holds
two collectives pending, the older one done in fact: read alone, its line is where that
older one was posted, not where it is. A peer says otherwise: an all-reduce (all-gather,
reduce-scatter, all-to-all, barrier) completes on a member only after every member has run
its part, so where a peer's entry of that group and number, of the same op, sizes and
dtypes, completed, the rank's own ran too. Only for a rank with a later collective pending:
that one is where it is (a rank's line is where its pending collective was posted).
"""

from __future__ import annotations

from moe_hang.analysis.program import signature
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective

# a member completes these only once every member has run its part (a broadcast's root,
# a reduce's or gather's senders may finish before the others have)
_EVERY_MEMBER = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                           "barrier", "allreduce_coalesced", "all_gather_into_tensor",
                           "reduce_scatter_tensor", "all_to_all_single"})


def _pending(by_pg: dict[str, dict[int, Collective]]) -> list[Collective]:
    return [c for coll in by_pg.values() for c in coll.values() if c.completed is False]


def done_by_peers(views: RankViews) -> dict[int, frozenset[tuple[str, int]]]:
    """Per rank, the (group, seq) of its pending collectives a peer's records show done,
    where the rank has another pending one they do not cover."""
    asked: dict[int, list[Collective]] = {}
    wanted: dict[str, set[int]] = {}
    for r, v in views.items():
        pending = _pending(v.tl.by_pg)
        if len(pending) < 2:
            continue
        asked[r] = [c for c in pending if c.seq is not None and c.op in _EVERY_MEMBER]
        for c in asked[r]:
            wanted.setdefault(c.pg, set()).add(c.seq)
    if not wanted:
        return {}
    # one pass over the ranks: the signatures each wanted (group, seq) was posted with, and
    # those it completed with on a peer that posted a later one of the group too (a count
    # takes in a collective that raised — gloo retires it — and a rank raises in the last it
    # ran: a later one says it went on)
    posted: dict[tuple[str, int], set[tuple[object, ...]]] = {}
    done: dict[tuple[str, int], set[tuple[object, ...]]] = {}
    for v in views.values():
        for pg, seqs in wanted.items():
            coll = v.tl.by_pg.get(pg)
            if coll is None:
                continue
            last = max(coll, default=-1)
            for s in seqs:
                entry = coll.get(s)
                if entry is None:
                    continue
                posted.setdefault((pg, s), set()).add(signature(entry))
                if entry.completed is True and s < last:
                    done.setdefault((pg, s), set()).add(signature(entry))
    out: dict[int, frozenset[tuple[str, int]]] = {}
    for r, cs in asked.items():
        # every member posted it alike: no mismatch there that could have failed it
        got = frozenset((c.pg, c.seq) for c in cs if len(posted[c.pg, c.seq]) == 1
                        and signature(c) in done.get((c.pg, c.seq), ()))
        if got and len(got) < len(_pending(views[r].tl.by_pg)):
            out[r] = got
    return out
