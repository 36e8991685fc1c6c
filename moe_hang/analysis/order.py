"""Which of two ranks is further along the same code — the one that went past the collective
the other waits in, i.e. skipped it (docs/DESIGN.md §8). From history first (in earlier
iterations, which call site followed which), then from program order (at the deepest frame
both stacks share, the statement that runs first, read from the source: lines in exclusive
branches of an ``if`` are not ordered at all). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import cast

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.source import Order, order
from moe_hang.analysis.timeline import (
    PostingKey,
    RankView,
    RankViews,
    group_kind,
    posting_key,
    site_key,
)
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, is_library_frame


@dataclass(frozen=True)
class Ahead:
    """The answer to "who is further along": ``side`` "a", "b" or None (undecided)."""

    side: str | None
    basis: CulpritBasis
    confirmed: bool = True  # False: from line numbers only (the source was not readable)


UNDECIDED = Ahead(None, CulpritBasis.AMBIGUOUS)


def user_frames(frames: list[Frame]) -> list[Frame]:
    """Outermost first, without torch's own frames."""
    return [f for f in reversed(frames) if not is_library_frame(f)]


def program_order(fa: list[Frame], fb: list[Frame], src: SourceFacts) -> Ahead:
    """Which of two user stacks (outermost frame first) is further along: at the deepest
    frame they share, the statement that runs later."""
    for x, y in zip(fa, fb, strict=False):
        if (x.file, x.function) != (y.file, y.function):
            return UNDECIDED
        if x.line == y.line:
            continue
        o = order(src, x.file, x.line, y.line)
        if o is Order.A_FIRST:
            return Ahead("b", CulpritBasis.PROGRAM_ORDER)
        if o is Order.B_FIRST:
            return Ahead("a", CulpritBasis.PROGRAM_ORDER)
        if o is Order.UNKNOWN:  # no source here: the line numbers, unconfirmed
            return Ahead("b" if x.line < y.line else "a", CulpritBasis.PROGRAM_ORDER, False)
        if o is Order.EXCLUSIVE:
            return UNDECIDED  # different branches: neither is "after" the other
    return UNDECIDED


def _history(a: Collective, b: Collective, views: RankViews) -> Ahead:
    """In earlier iterations, did one collective's call site directly follow the other's?
    Then the side now at the later one went on without the earlier one."""
    ka, kb = site_key(a), site_key(b)
    if not (ka and kb and ka != kb):
        return UNDECIDED
    a_then_b = b_then_a = False
    for v in views.values():
        keys = [site_key(c) for c in sorted(v.tl.by_pg.get(a.pg, {}).values(),
                                            key=lambda c: c.seq)]
        for k1, k2 in pairwise(keys):
            a_then_b |= (k1, k2) == (ka, kb)
            b_then_a |= (k1, k2) == (kb, ka)
    if a_then_b and not b_then_a:
        return Ahead("b", CulpritBasis.HISTORY)
    if b_then_a and not a_then_b:
        return Ahead("a", CulpritBasis.HISTORY)
    return UNDECIDED


def who_skipped(a: Collective, b: Collective, views: RankViews,
                ra: list[int], rb: list[int]) -> Ahead:
    """Which side posted a *later* collective in place of the other's, i.e. skipped one."""
    hist = _history(a, b, views)
    if hist.side is not None:
        return hist
    fa = user_frames(a.frames) or views[ra[0]].position
    fb = user_frames(b.frames) or views[rb[0]].position
    return program_order(fa, fb, views.source)


def further_along(r: int, waiting: Collective, views: RankViews,
                  waiter: int) -> Ahead:
    """Is rank ``r`` (which never posted ``waiting``) further along than ``waiter`` (which
    waits in it)? "a": yes — it went past and skipped it; "b": it is behind, held up earlier.
    From the stacks' program order, else from the order the ranks posted collectives in."""
    fw = user_frames(waiting.frames) or views[waiter].position
    by_code = program_order(views[r].position, fw, views.source)
    return by_code if by_code.side is not None else posted_past(r, waiting, views)


def posted_past(r: int, waiting: Collective, views: RankViews) -> Ahead:
    """Without stacks: rank ``r`` went past ``waiting`` when it posted something that, in the
    ranks that posted both, came after it (and never before it); it is behind when the last
    thing it posted came before it."""
    x = posting_key(waiting)
    after: set[PostingKey] = set()
    before: set[PostingKey] = set()
    for q in views:
        order = views.posting_keys(q)
        if x in order:
            i = order.index(x)
            before.update(order[:i])
            after.update(order[i + 1:])
    mine = views.posting_keys(r)
    if not mine or x in mine:
        return UNDECIDED
    if any(y in after and y not in before for y in mine):
        return Ahead("a", CulpritBasis.HISTORY)
    if mine[-1] in before and mine[-1] not in after:
        return Ahead("b", CulpritBasis.HISTORY)
    return UNDECIDED


def _key(c: Collective) -> tuple[object, ...]:
    return (c.pg, c.op, tuple(tuple(s) for s in c.input_sizes), site_key(c))


def _sequence(v: RankView) -> list[Collective]:
    """Every collective of a rank, across its groups, in the order it posted them."""
    colls = [c for by_seq in v.tl.by_pg.values() for c in by_seq.values()
             if c.time_created_ns is not None]
    return sorted(colls, key=lambda c: (c.time_created_ns or 0, c.pg, c.seq))


def breaks_history(r: int, views: RankViews) -> bool | None:
    """Is the collective rank ``r`` is blocked in not what, in earlier iterations (of any
    rank), followed the one it posted before it? None: no history to tell."""
    v = views[r]
    mine = _sequence(v)
    if v.current is None or len(mine) < 3 or mine[-1] is not v.current:
        return None
    before, now = _key(mine[-2]), _key(mine[-1])
    followers: set[tuple[object, ...]] = set()
    for other in views.values():
        past = _sequence(other)
        if other.current is not None and past and past[-1] is other.current:
            past = past[:-1]  # what each rank waits in now is not history
        followers.update(_key(b) for a, b in pairwise(past) if _key(a) == before)
    if not followers:
        return None
    return now not in followers


@dataclass(frozen=True)
class Inversion:
    """Two collectives that the ranks posting both posted in opposite orders."""

    first: Collective  # as the culprits posted them: ``first`` before ``second``
    second: Collective
    culprits: list[int]
    others: list[int]  # posted ``second`` before ``first``
    basis: CulpritBasis  # HISTORY: the culprits broke the order of earlier steps; MAJORITY


def _order_of(v: RankView, x: tuple[str, int], y: tuple[str, int]) -> bool | None:
    """Did the rank post x before y (record ids)? None: it did not post both."""
    ids: dict[tuple[str, int], int] = {}
    for c in v.ev.fr.entries if v.ev.fr is not None else []:
        if (c.pg, c.seq) in (x, y) and c.record_id is not None:
            ids[(c.pg, c.seq)] = c.record_id
    return ids[x] < ids[y] if len(ids) == 2 else None


def _shape(c: Collective) -> tuple[object, ...]:
    return (group_kind(c), c.op, tuple(tuple(s) for s in c.input_sizes))


Followers = dict[tuple[object, ...], set[tuple[object, ...]]]


def _followers(views: RankViews) -> Followers:
    """In the completed history of every rank: which shape of collective came next after
    each shape (a loop's steps repeat: what came after X before, comes after X again).
    Worked out once per diagnosis."""
    memo = views.memo.get(("followers",))
    if memo is not None:
        return cast(Followers, memo)
    out: Followers = {}
    for r in views:
        done = [c for c in views.posting_order(r) if c.completed is True]
        for a, b in pairwise(done):
            out.setdefault(_shape(a), set()).add(_shape(b))
    views.memo[("followers",)] = out
    return out


def _keeps_history(r: int, views: RankViews, first: Collective,
                   follow: Followers) -> bool | None:
    """Does the collective the rank posted first of the two follow the one it posted before
    it the way earlier steps did? None: no history for that one."""
    seq = views.posting_order(r)
    i = next((j for j, c in enumerate(seq) if (c.pg, c.seq) == (first.pg, first.seq)), None)
    if not i:
        return None
    nxt = follow.get(_shape(seq[i - 1]))
    return None if not nxt else _shape(first) in nxt


def inversion(x: Collective, y: Collective, views: RankViews) -> Inversion | None:
    """The ranks that posted both x and y, split by the order they posted them in; the side
    that broke the order every rank's earlier steps kept is the culprit, else a strict
    minority; else undecided (None). Every cycle through the same two collectives asks the
    same: one answer per diagnosis."""
    question = ("inversion", x.pg, x.seq, y.pg, y.seq)
    if question not in views.memo:
        views.memo[question] = _inversion(x, y, views)
    return cast("Inversion | None", views.memo[question])


def _posted_both(x: Collective, y: Collective, views: RankViews) -> list[int]:
    """The ranks that can have posted both: members of both groups (every rank where no dump
    lists the groups)."""
    for v in views.values():
        fr = v.ev.fr
        if fr is not None and x.pg in fr.pg_ranks and y.pg in fr.pg_ranks:
            both = set(fr.pg_ranks[x.pg]) & set(fr.pg_ranks[y.pg])
            return sorted(r for r in both if r in views)
    return sorted(views)


def _inversion(x: Collective, y: Collective, views: RankViews) -> Inversion | None:
    kx, ky = (x.pg, x.seq), (y.pg, y.seq)
    cands = _posted_both(x, y, views)
    xy = [r for r in cands if _order_of(views[r], kx, ky) is True]
    yx = [r for r in cands if _order_of(views[r], kx, ky) is False]
    if not xy or not yx:
        return None
    follow = _followers(views)
    kept = {r: _keeps_history(r, views, x if r in xy else y, follow) for r in xy + yx}
    for bad, good in ((xy, yx), (yx, xy)):
        if all(kept[r] is False for r in bad) and all(kept[r] is True for r in good):
            return _inv(bad, good, x, y, views, CulpritBasis.HISTORY)
    if len(xy) != len(yx):
        bad, good = (xy, yx) if len(xy) < len(yx) else (yx, xy)
        return _inv(bad, good, x, y, views, CulpritBasis.MAJORITY)
    return None


def _inv(bad: list[int], good: list[int], x: Collective, y: Collective,
         views: RankViews, basis: CulpritBasis) -> Inversion:
    first, second = (x, y) if _order_of(views[bad[0]], (x.pg, x.seq), (y.pg, y.seq)) else (y, x)
    return Inversion(first, second, bad, good, basis)
