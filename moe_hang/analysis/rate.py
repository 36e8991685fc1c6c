"""A helper thread fed by the main loop: one collective per lap (pure; docs/DESIGN.md §8.5).

A metrics or logging thread posts on a group of its own, one collective for each item the
main loop hands it. Where two ranks' threads posted different numbers there, no majority
exists on two ranks and the thread's collectives all look alike; what the program kept is the
*rate*: on every rank, the thread's j-th collective came within a lap of the main loop's j-th
(learned from the recorders' own posting order, the lap counted by a main-thread collective
every rank posted equally often). Against that rate each rank's count says whether it
deviated:

- a thread that has ended posted all it ever will: it deviated if it posted other than one per
  lap (fewer: a skipped item; more: an extra);
- a thread still alive, blocked in its collective, deviated if it posted more than one per
  lap; one per lap exactly is the program; fewer may be a backlog it would still post
  (unknown).

Nothing is claimed where the recorders do not hold the whole history of both groups, where
threads are not recorded, or where no lap marker keeps the rate on every rank."""

from __future__ import annotations

from collections.abc import Sequence

from moe_hang.analysis.timeline import RankViews, group_kind
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import callsite
from moe_hang.evidence.vocab import who

Key = tuple[str, str, tuple[tuple[int, ...], ...], tuple[str, ...]]


def _key(c: Collective) -> Key:
    """What marks one main-thread collective as the same call on every rank."""
    return (group_kind(c), c.op, tuple(tuple(s) for s in c.input_sizes), tuple(c.dtypes))


def _whole(colls: Sequence[Collective]) -> bool:
    """The recorder held every collective of the group (its first seq is still there)."""
    seqs = sorted(c.seq for c in colls)
    return bool(seqs) and seqs[0] <= 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def _threads(views: RankViews, pg: str, r: int
             ) -> tuple[list[Collective], list[Collective]] | None:
    """(the thread's collectives on ``pg``, every other thread's), in posting order, where
    one thread posted all of ``pg`` and the recorder holds all of it."""
    order = views.posting_order(r)
    if not order or any(c.thread_id is None for c in order):
        return None
    mine = [c for c in order if c.pg == pg]
    ids = {c.thread_id for c in mine}
    if len(ids) != 1 or not _whole(mine):
        return None
    poster = next(iter(ids))
    return mine, [c for c in order if c.thread_id != poster]


def _keeps_pace(order: list[Collective], thread: list[Collective], key: Key, upto: int) -> bool:
    """The thread's j-th collective (j <= upto) came within one lap of the j-th lap: one
    per lap, whether the loop hands it its item before the marker or after."""
    pos = {id(c): k for k, c in enumerate(order)}
    laps = [pos[id(c)] for c in order if _key(c) == key and c.thread_id != thread[0].thread_id]
    for j, c in enumerate(thread[:upto], start=1):
        before = sum(1 for p in laps if p < pos[id(c)])
        if abs(before - j) > 1:
            return False
    return True


def laps(views: RankViews, pg: str, ranks: Sequence[int]) -> int | None:
    """The laps of the main loop that fed the thread posting on ``pg`` (the same on every
    rank of ``ranks``), where a main-thread collective every rank posted that often keeps
    the thread's pace on every rank; None where none does, or markers disagree."""
    got: dict[int, tuple[list[Collective], list[Collective]]] = {}
    for r in ranks:
        g = _threads(views, pg, r)
        if g is None or not g[1]:
            return None  # (one thread posts everything: no helper, no lap to count it by)
        got[r] = g
    if len(got) < 2:
        return None
    upto = min(len(thread) for thread, _ in got.values())
    per: list[dict[Key, int]] = []
    for _, rest in got.values():
        n_of: dict[Key, int] = {}
        for c in rest:
            n_of[_key(c)] = n_of.get(_key(c), 0) + 1
        per.append(n_of)
    counts = {k: {p.get(k, 0) for p in per} for p0 in per for k in p0}
    found: set[int] = set()
    order = {r: views.posting_order(r) for r in got}
    for key, ns in counts.items():
        if len(ns) != 1 or (n := next(iter(ns))) < 2:
            continue  # not posted equally often on every rank, or no loop
        if all(_whole([c for c in order[r] if group_kind(c) == key[0]])
               and _keeps_pace(order[r], thread, key, upto)
               for r, (thread, _) in got.items()):
            found.add(n)
    return found.pop() if len(found) == 1 else None


def deviates(views: RankViews, pg: str, ranks: Sequence[int]) -> dict[int, bool | None] | None:
    """rank -> whether its thread on ``pg`` broke the one-per-lap rate (None: not known);
    None where no rate is known."""
    n = laps(views, pg, ranks)
    if n is None:
        return None
    out: dict[int, bool | None] = {}
    for r in ranks:
        posted = max(c.seq for c in views[r].tl.by_pg[pg].values())
        if views.poster_ended(r, pg):
            out[r] = posted != n
        else:
            out[r] = True if posted > n else False if posted == n else None
    return out


def rate_vote(culprits: Sequence[int], others: Sequence[int], pg: str,
              views: RankViews) -> bool | None:
    """The ladder's answer from the rate: True where the culprits alone broke it, False
    where the others alone did, else None."""
    dev = deviates(views, pg, [*culprits, *others])
    if dev is None or any(v is None for v in dev.values()):
        return None
    if all(dev[r] for r in culprits) and not any(dev[r] for r in others):
        return True
    if all(dev[r] for r in others) and not any(dev[r] for r in culprits):
        return False
    return None


def rate_advice(culprits: Sequence[int], others: Sequence[int], pg: str, what: str,
                views: RankViews) -> str | None:
    """The fix where the rate decided: how many the culprits' thread posted for how many
    laps, against the one per lap every other rank's thread kept."""
    ranks = [*culprits, *others]
    n = laps(views, pg, ranks)
    if n is None or not culprits:
        return None
    posted = {r: max(c.seq for c in views[r].tl.by_pg[pg].values()) for r in ranks}
    # the thread's call: the line the user changes (any rank's entry that has frames)
    mine = [c for r in ranks for c in views[r].tl.by_pg[pg].values()]
    site = next((s for c in mine if c.frames and (s := callsite(c.frames)) is not None), None)
    what = f"the {mine[0].op} {what}" + (f" at {site.short()}" if site is not None else "")
    counts = sorted({posted[r] for r in culprits})
    one = len(culprits) == 1
    many = " or ".join(str(c) for c in counts)
    how = ("one fewer" if counts == [n - 1] else "one more" if counts == [n + 1]
           else "other than one a lap")
    return (f"{who(culprits).capitalize()}'s thread that posts {what} posted {many} for "
            f"{'its' if one else 'their'} main loop's {n} laps ({how}), where "
            f"{who(others)}'s posted one per lap, the pace every rank's thread kept. Make "
            "every rank's thread post once per lap: the same items handed to it on every "
            "rank, none skipped by a rank alone (or post that collective from the main loop).")
