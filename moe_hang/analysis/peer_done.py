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
from moe_hang.evidence.flight_recorder import DEFAULT_PG, Collective

# a member completes these only once every member has run its part (a broadcast's root,
# a reduce's or gather's senders may finish before the others have)
_EVERY_MEMBER = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                           "barrier", "allreduce_coalesced", "all_gather_into_tensor",
                           "reduce_scatter_tensor", "all_to_all_single"})


def _scan(views: RankViews, wanted: dict[str, set[int]], done: bool
          ) -> dict[tuple[str, int], list[tuple[object, ...]]]:
    """Per wanted (group, seq), the signature of each rank's entry there (``done``: only of
    those that completed it and posted a later one of the group too — a count takes in a
    collective that raised, gloo retires it, and a rank raises in the last it ran); with
    ``done`` False, a rank that holds the group but no entry there counts as None."""
    out: dict[tuple[str, int], list[tuple[object, ...]]] = {}
    for v in views.values():
        for pg, coll in v.tl.by_pg.items():  # its few groups, not every one asked about
            if (seqs := wanted.get(pg)) is None:
                continue
            last = v.tl.enqueued.get(pg, -1)  # the last it posted on the group
            for s in seqs:
                entry = coll.get(s)
                if entry is None and not done:
                    out.setdefault((pg, s), []).append((None,))
                elif entry is not None and (not done or (entry.completed is True
                                                         and s < last)):
                    out.setdefault((pg, s), []).append(signature(entry))
    return out


def done_by_peers(views: RankViews) -> dict[int, frozenset[tuple[str, int]]]:
    """Per rank, the (group, seq) of its pending collectives a peer's records show done,
    where the rank has another pending one they do not cover."""
    asked: dict[int, list[Collective]] = {}
    wanted: dict[str, set[int]] = {}
    for r, v in views.items():
        if len(v.pending) < 2:
            continue
        asked[r] = [c for c in v.pending if c.seq is not None and c.op in _EVERY_MEMBER]
        for c in asked[r]:
            wanted.setdefault(c.pg, set()).add(c.seq)
    done = _scan(views, wanted, done=True) if wanted else {}
    if not done:  # nothing a peer saw complete (NCCL's enqueued-ahead ranks, as a rule)
        return {}
    seen: dict[str, set[int]] = {}
    for pg, seq in done:
        seen.setdefault(pg, set()).add(seq)
    posted = _scan(views, seen, done=False)
    # every rank is a member of the default group: one without records of it is unknown
    whole = all(DEFAULT_PG in v.tl.by_pg for v in views.values())
    out: dict[int, frozenset[tuple[str, int]]] = {}
    for r, cs in asked.items():
        # every member posted it, alike: no mismatch there, and no member missing from it,
        # that could have failed it
        got = frozenset((c.pg, c.seq) for c in cs if (c.pg, c.seq) in done
                        and len(set(posted[c.pg, c.seq])) == 1
                        and (c.pg != DEFAULT_PG or whole)
                        and signature(c) in done[c.pg, c.seq])
        if got and len(got) < len(views[r].pending):
            out[r] = got
    return out
