"""Which of two ranks is further along the same code — the one that went past the collective
the other waits in, i.e. skipped it (docs/DESIGN.md §8). From history first (in earlier
iterations, which call site followed which), then from program order (at the deepest frame
both stacks share, the statement that runs first, read from the source: lines in exclusive
branches of an ``if`` are not ordered at all). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.source import Order, order
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame

if TYPE_CHECKING:
    from moe_hang.analysis.timeline import RankView


@dataclass(frozen=True)
class Ahead:
    """The answer to "who is further along": ``side`` "a", "b" or None (undecided)."""

    side: str | None
    basis: CulpritBasis
    confirmed: bool = True  # False: from line numbers only (the source was not readable)


UNDECIDED = Ahead(None, CulpritBasis.AMBIGUOUS)


def site_key(c: Collective) -> tuple[str, object] | None:
    site = callsite(c.frames) if c.frames else None
    if site is not None:
        return (site.file, site.line)
    return ("probe", c.name) if c.name else None


def user_frames(frames: list[Frame]) -> list[Frame]:
    """Outermost first, without torch's own frames."""
    return [f for f in reversed(frames) if not is_library_frame(f)]


def program_order(fa: list[Frame], fb: list[Frame]) -> Ahead:
    """Which of two user stacks (outermost frame first) is further along: at the deepest
    frame they share, the statement that runs later."""
    for x, y in zip(fa, fb, strict=False):
        if (x.file, x.function) != (y.file, y.function):
            return UNDECIDED
        if x.line == y.line:
            continue
        o = order(x.file, x.line, y.line)
        if o is Order.A_FIRST:
            return Ahead("b", CulpritBasis.PROGRAM_ORDER)
        if o is Order.B_FIRST:
            return Ahead("a", CulpritBasis.PROGRAM_ORDER)
        if o is Order.UNKNOWN:  # no source here: the line numbers, unconfirmed
            return Ahead("b" if x.line < y.line else "a", CulpritBasis.PROGRAM_ORDER, False)
        if o is Order.EXCLUSIVE:
            return UNDECIDED  # different branches: neither is "after" the other
    return UNDECIDED


def _history(a: Collective, b: Collective, views: dict[int, RankView]) -> Ahead:
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


def who_skipped(a: Collective, b: Collective, views: dict[int, RankView],
                ra: list[int], rb: list[int]) -> Ahead:
    """Which side posted a *later* collective in place of the other's, i.e. skipped one."""
    hist = _history(a, b, views)
    if hist.side is not None:
        return hist
    fa = user_frames(a.frames) or views[ra[0]].position
    fb = user_frames(b.frames) or views[rb[0]].position
    return program_order(fa, fb)


def further_along(r: int, waiting: Collective, views: dict[int, RankView],
                  waiter: int) -> Ahead:
    """Is rank ``r`` (which never posted ``waiting``) further along than ``waiter`` (which
    waits in it)? "a": yes — it went past and skipped it; "b": it is behind, held up earlier.
    From the stacks' program order, else from the order the ranks posted collectives in."""
    fw = user_frames(waiting.frames) or views[waiter].position
    by_code = program_order(views[r].position, fw)
    return by_code if by_code.side is not None else posted_past(r, waiting, views)


def group_kind(c: Collective) -> str:
    """Comparable across ranks: a mesh dim's groups share a description (``mesh_tp``), not a
    name (each rank's tp group is another group)."""
    return c.pg_desc if c.pg_desc and c.pg_desc != "undefined" else c.pg


def _item(c: Collective) -> tuple[str, int, str]:
    # a group's seq counts its collectives: in a program every rank runs alike, the n-th
    # collective of every tp group is the same step's, on every rank, ring buffer or not
    return (group_kind(c), c.seq, c.op)


def _in_posting_order(v: RankView) -> list[Collective]:
    if v.posting_order is not None:
        return v.posting_order
    v.posting_order = _posting_order(v)  # asked once per edge on thousands of ranks
    return v.posting_order


def _items_of(v: RankView) -> list[tuple[str, int, str]]:
    if v.posting_items is None:
        v.posting_items = [_item(c) for c in _in_posting_order(v)]
    return v.posting_items


def _posting_order(v: RankView) -> list[Collective]:
    colls = [c for by_seq in v.tl.by_pg.values() for c in by_seq.values()]
    if colls and all(c.record_id is not None for c in colls):
        return sorted(colls, key=lambda c: c.record_id or 0)
    if colls and all(c.time_created_ns is not None for c in colls):
        return sorted(colls, key=lambda c: (c.time_created_ns or 0, c.pg, c.seq))
    return []


def posted_past(r: int, waiting: Collective, views: dict[int, RankView]) -> Ahead:
    """Without stacks: rank ``r`` went past ``waiting`` when it posted something that, in the
    ranks that posted both, came after it (and never before it); it is behind when the last
    thing it posted came before it."""
    x = _item(waiting)
    after: set[tuple[str, int, str]] = set()
    before: set[tuple[str, int, str]] = set()
    for v in views.values():
        order = _items_of(v)
        if x in order:
            i = order.index(x)
            before.update(order[:i])
            after.update(order[i + 1:])
    mine = _items_of(views[r])
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


def breaks_history(r: int, views: dict[int, RankView]) -> bool | None:
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


def _followers(views: dict[int, RankView]) -> dict[tuple[object, ...], set[tuple[object, ...]]]:
    """In the completed history of every rank: which shape of collective came next after
    each shape (a loop's steps repeat: what came after X before, comes after X again)."""
    out: dict[tuple[object, ...], set[tuple[object, ...]]] = {}
    for v in views.values():
        done = [c for c in _in_posting_order(v) if c.completed is True]
        for a, b in pairwise(done):
            out.setdefault(_shape(a), set()).add(_shape(b))
    return out


def _keeps_history(v: RankView, first: Collective,
                   follow: dict[tuple[object, ...], set[tuple[object, ...]]]) -> bool | None:
    """Does the collective the rank posted first of the two follow the one it posted before
    it the way earlier steps did? None: no history for that one."""
    seq = _in_posting_order(v)
    i = next((j for j, c in enumerate(seq) if (c.pg, c.seq) == (first.pg, first.seq)), None)
    if not i:
        return None
    nxt = follow.get(_shape(seq[i - 1]))
    return None if not nxt else _shape(first) in nxt


def inversion(x: Collective, y: Collective, views: dict[int, RankView]) -> Inversion | None:
    """The ranks that posted both x and y, split by the order they posted them in; the side
    that broke the order every rank's earlier steps kept is the culprit, else a strict
    minority; else undecided (None)."""
    kx, ky = (x.pg, x.seq), (y.pg, y.seq)
    memo = _MEMO.get("inversion")
    if memo is not None and memo[0] is views and memo[1] == (kx, ky):
        return memo[2]  # every cycle through the same two collectives: one answer
    got = _inversion(x, y, views)
    _MEMO["inversion"] = (views, (kx, ky), got)
    return got


# single-entry memos, keyed by the identity of the ranks' views (one diagnosis at a time):
# on thousands of ranks, hundreds of cycles through the same two collectives ask the same
_MEMO: dict[str, tuple[Any, ...]] = {}


def forget() -> None:
    """Drop the memos (the end of a diagnosis: nothing of it stays referenced)."""
    _MEMO.clear()


def _posted_both(x: Collective, y: Collective, views: dict[int, RankView]) -> list[int]:
    """The ranks that can have posted both: members of both groups (every rank where no dump
    lists the groups)."""
    for v in views.values():
        fr = v.ev.fr
        if fr is not None and x.pg in fr.pg_ranks and y.pg in fr.pg_ranks:
            both = set(fr.pg_ranks[x.pg]) & set(fr.pg_ranks[y.pg])
            return sorted(r for r in both if r in views)
    return sorted(views)


def _inversion(x: Collective, y: Collective, views: dict[int, RankView]) -> Inversion | None:
    kx, ky = (x.pg, x.seq), (y.pg, y.seq)
    cands = _posted_both(x, y, views)
    xy = [r for r in cands if _order_of(views[r], kx, ky) is True]
    yx = [r for r in cands if _order_of(views[r], kx, ky) is False]
    if not xy or not yx:
        return None
    memo = _MEMO.get("followers")
    if memo is not None and memo[0] is views:
        follow = memo[1]
    else:
        follow = _followers(views)
        _MEMO["followers"] = (views, follow)
    kept = {r: _keeps_history(views[r], x if r in xy else y, follow) for r in xy + yx}
    for bad, good in ((xy, yx), (yx, xy)):
        if all(kept[r] is False for r in bad) and all(kept[r] is True for r in good):
            return _inv(bad, good, x, y, views, CulpritBasis.HISTORY)
    if len(xy) != len(yx):
        bad, good = (xy, yx) if len(xy) < len(yx) else (yx, xy)
        return _inv(bad, good, x, y, views, CulpritBasis.MAJORITY)
    return None


def _inv(bad: list[int], good: list[int], x: Collective, y: Collective,
         views: dict[int, RankView], basis: CulpritBasis) -> Inversion:
    first, second = (x, y) if _order_of(views[bad[0]], (x.pg, x.seq), (y.pg, y.seq)) else (y, x)
    return Inversion(first, second, bad, good, basis)
