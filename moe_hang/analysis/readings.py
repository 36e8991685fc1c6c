"""The readings of a divergence — each way the evidence can be explained by some ranks
deviating from what the others did (docs/DESIGN.md §8.4) — for :func:`.ladder.decide` to weigh.
Pure, detection only: nothing here decides.

- at one sequence number, camps that posted different collectives: each camp in turn followed
  the program and every other deviated there;
- a block one camp posted and the other did not (:mod:`.blocks`, both ways the diff reads):
  an extra on the camp that has it, or a skip of the camp that lacks it;
- a member absent from what the others wait in: it went past (a skip), or the others' is an
  extra, or it is only held up before it (a consequence);
- two ranks that posted two groups' collectives in opposite orders: a swap on either side.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import cast

from moe_hang.analysis.blocks import Block
from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.ladder import Edit, Reading, left_the_loop
from moe_hang.analysis.program import P2P_OPS, Program
from moe_hang.analysis.timeline import (
    PostingKey,
    RankView,
    RankViews,
    group_kind,
    posting_key,
)
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame, is_library_frame


def user_frames(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """Outermost first, without torch's own frames."""
    return tuple(f for f in reversed(frames) if not is_library_frame(f))


def at(c: Collective | None, v: RankView) -> tuple[Frame, ...]:
    """Where a rank is for ``c``: the frames that posted it, else its stack (still in it)."""
    if c is not None and c.frames and c.source != "probe":
        return user_frames(c.frames)
    return tuple(v.position)


def prev_of(pg: str, seq: int | None, ranks: Iterable[int], views: RankViews
            ) -> Collective | None:
    """The collective every member posted right before ``seq`` (the last agreed one)."""
    if seq is None:
        return None
    for r in ranks:
        c = views[r].tl.by_pg.get(pg, {}).get(seq - 1)
        if c is not None:
            return c
    return None


def camp_readings(pg: str, seq: int | None, camps: Sequence[list[int]],
                  entries: dict[int, Collective | None], views: RankViews,
                  edit: Edit = Edit.CHANGE) -> list[Reading]:
    """Camps that posted different collectives at one seq (``entries``: each rank's): for each
    camp, the reading where it followed the program and every other camp deviated."""
    every = [r for c in camps for r in c]
    prev = prev_of(pg, seq, every, views)
    out = []
    for keep in camps:
        rest = [c for c in camps if c is not keep]
        culprits = tuple(sorted(r for c in rest for r in c))
        mines = tuple(m for c in rest if (m := entries.get(c[0])) is not None)
        theirs = entries.get(keep[0])
        ats = tuple(at(entries.get(c[0]), views[c[0]]) for c in rest)
        out.append(Reading(culprits, tuple(sorted(keep)), edit,
                           mine=mines[0] if mines else None, theirs=theirs, prev=prev,
                           mines=mines, at_mine=ats[0], at_mines=ats,
                           at_theirs=at(theirs, views[keep[0]])))
    return out


def block_readings(pg: str, blocks: Sequence[Block], views: RankViews) -> list[Reading]:
    """Each block, read as an extra of the camp that has it and as a skip of the camp that
    lacks it."""
    out = []
    for b in blocks:
        prev = prev_of(pg, b.start, b.having + b.lacking, views)
        first = b.items[0] if b.items else None
        have_at = at(first, views[b.having[0]])
        lack_at = at(b.lacking_next, views[b.lacking[0]])
        items = tuple(b.items)
        extra = Reading(tuple(b.having), tuple(b.lacking), Edit.EXTRA, mine=first,
                        theirs=b.lacking_next, prev=prev, block=items, at_mine=have_at,
                        at_theirs=lack_at, realigned=True)
        tagged = _tagged_in_order(b, pg, views)
        skip = Reading(tuple(b.lacking), tuple(b.having), Edit.SKIP, mine=b.lacking_next,
                       theirs=first, prev=prev, block=items, at_mine=lack_at, at_theirs=have_at,
                       realigned=True,
                       given={CulpritBasis.PROGRAM_ORDER: True} if tagged else {})
        if b.placed:  # from a line none of its earlier steps posted from: its extra
            extra = replace(extra, given={**extra.given, CulpritBasis.HISTORY: True})
            skip = replace(skip, given={**skip.given, CulpritBasis.HISTORY: False})
        if b.posted_from:
            # placed by the source, its collectives carry no call site and are alike the
            # step's own: what the steps posted cannot tell an extra copy from a skip; the
            # having side is where the source puts it
            extra = replace(extra, at_mine=b.posted_from,
                            given={**extra.given, CulpritBasis.HISTORY: None})
            skip = replace(skip, at_theirs=b.posted_from,
                           given={**skip.given, CulpritBasis.HISTORY: None})
        out += [extra, skip]
    return out


def _tagged_in_order(b: Block, pg: str, views: RankViews) -> bool:
    """The probe's tags (``layer1.expert2``) name each logical collective of a step, in the
    order the program posts them: the block is one of them, and the lacking ranks posted the
    one that follows it in its place — they went past it."""
    if not b.items or not all(c.tag for c in b.items):
        return False
    having = [c for s, c in sorted(views[b.having[0]].tl.by_pg.get(pg, {}).items())
              if s >= b.start]
    nxt = having[len(b.items):len(b.items) + 1]
    return bool(nxt and b.lacking_next is not None and nxt[0].tag
                and nxt[0].tag == b.lacking_next.tag)


def absent_readings(waiting: Collective, waiters: Sequence[int], absent: int,
                    views: RankViews) -> list[Reading]:
    """A member absent from the collective ``waiters`` wait in: it went past it (a skip),
    or it is held up before it (behind: a consequence) — by the order the ranks posted
    collectives in, across groups (history), and where its stack is (program order)."""
    v = views[absent]
    now = v.current if v.current is not None and v.current is not waiting else None
    mine_at, theirs_at = tuple(v.position), at(waiting, views[waiters[0]])
    past = posted_past(absent, waiting, views)
    if past is False and v.stack.op in P2P_OPS and (now is None or now.op != v.stack.op):
        # it is in a send/recv its recorder keeps no entry of (gloo's): it went on past the
        # last collective the recorder shows, so that one says nothing of where it is
        past = None
    ended = views.poster_ended(absent, waiting.pg)
    skip = Reading((absent,), tuple(waiters), Edit.SKIP, mine=now, theirs=waiting,
                   prev=before(absent, now, views), block=(waiting,),
                   prev_theirs=before(waiters[0], waiting, views), posted_order=True,
                   at_mine=mine_at, at_theirs=theirs_at,
                   given={CulpritBasis.HISTORY: True} if past is True else
                   # its thread for that group ended: that one more was never part of its
                   # run is what the steps cannot tell (a loop over a queue ends when it ends)
                   {CulpritBasis.HISTORY: None, CulpritBasis.MAJORITY: None} if ended else
                   {CulpritBasis.MAJORITY: None})
    behind = Reading((absent,), tuple(waiters), Edit.BEHIND, mine=now, theirs=waiting,
                     at_mine=mine_at, at_theirs=theirs_at,
                     given={CulpritBasis.HISTORY: False if ended else
                            True if past is False else None})
    return [skip, behind]


def extra_reading(waiting: Collective, waiters: Sequence[int], absent: Sequence[int],
                  views: RankViews) -> Reading:
    """What the waiters wait in is an extra of theirs (it runs under a branch only they
    take): the absent ranks owe nothing. Only the source can say so: the others' side is
    not known (where they are is not what they would post here), and a collective no step
    posted before may as well be the next phase of the program (the barrier after the
    training loop)."""
    # where every absent rank's thread for that group has ended, none will post it: the
    # ranks that did are counted against those that never will
    ended = bool(absent) and all(views.poster_ended(a, waiting.pg) for a in absent)
    given: dict[CulpritBasis, bool | None] = {CulpritBasis.HISTORY: None,
                                              CulpritBasis.PROGRAM_ORDER: None}
    if not ended:
        given[CulpritBasis.MAJORITY] = None
    return Reading(tuple(sorted(waiters)), tuple(sorted(absent)), Edit.EXTRA, mine=waiting,
                   block=(waiting,), prev=prev_of(waiting.pg, waiting.seq, waiters, views),
                   at_mine=at(waiting, views[waiters[0]]),
                   at_theirs=tuple(views[absent[0]].position) if absent else (),
                   given=given)


def before(r: int, c: Collective | None, views: RankViews) -> Collective | None:
    """What rank ``r`` posted right before ``c``, on any group (the posting order of the
    thread that posted it)."""
    if c is None:
        return None
    order = views.order_with(r, c)
    i = next((j for j, x in enumerate(order) if (x.pg, x.seq) == (c.pg, c.seq)), None)
    return order[i - 1] if i else None


def posted_past(r: int, waiting: Collective, views: RankViews) -> bool | None:
    """Without stacks: rank ``r`` went past ``waiting`` when it posted something that, in the
    ranks that posted both, came after it (and never before it) — True; it is behind when
    the last thing it posted came before it — False; None: the order does not say."""
    x = posting_key(waiting)
    after: set[PostingKey] = set()
    before: set[PostingKey] = set()
    for q in views:
        for thread in views.thread_orders(q):
            order = [posting_key(c) for c in thread]
            if x in order:
                i = order.index(x)
                before.update(order[:i])
                after.update(order[i + 1:])
    # its thread that posts on that group (its whole order where threads are not known)
    mine = next(([posting_key(c) for c in t] for t in views.thread_orders(r)
                 if any(c.pg == waiting.pg for c in t)), views.posting_keys(r))
    if not mine or x in mine:
        return None
    if any(y in after and y not in before for y in mine):
        return True
    if mine[-1] in before and mine[-1] not in after:
        return False
    return None


# ------------------------------------------------------------------ two groups, two orders


@dataclass(frozen=True)
class Inversion:
    """Two collectives that the ranks posting both posted in opposite orders."""

    first: Collective  # as the culprits posted them: ``first`` before ``second``
    second: Collective
    culprits: list[int]
    others: list[int]  # posted ``second`` before ``first``
    basis: CulpritBasis  # HISTORY: the culprits broke the order of earlier steps; MAJORITY


def _order_of(r: int, views: RankViews, x: tuple[str, int], y: tuple[str, int]
              ) -> bool | None:
    """Did the rank post x before y (its posting order: record ids, else creation times)?
    None: it did not post both."""
    for order in views.thread_orders(r):  # two threads' collectives have no order
        at = {(c.pg, c.seq): i for i, c in enumerate(order) if (c.pg, c.seq) in (x, y)}
        if len(at) == 2:
            return at[x] < at[y]
    return None


def _shape(c: Collective) -> tuple[object, ...]:
    return (group_kind(c), c.op, tuple(tuple(s) for s in c.input_sizes))


Followers = dict[tuple[object, ...], set[tuple[object, ...]]]


def _followers(views: RankViews) -> Followers:
    """In the completed history of every rank: which shape of collective came next after
    each shape, across groups, in posting order. Worked out once per diagnosis."""
    memo = views.memo.get(("followers",))
    if memo is not None:
        return cast(Followers, memo)
    out: Followers = {}
    for r in views:
        for order in views.thread_orders(r):
            done = [c for c in order if c.completed is True]
            for a, b in pairwise(done):
                out.setdefault(_shape(a), set()).add(_shape(b))
    views.memo[("followers",)] = out
    return out


def _keeps_history(r: int, views: RankViews, first: Collective,
                   follow: Followers) -> bool | None:
    """Does the collective the rank posted first of the two follow the one it posted before
    it the way earlier steps did? None: no history for that one."""
    prev = before(r, first, views)
    nxt = follow.get(_shape(prev)) if prev is not None else None
    return None if not nxt else _shape(first) in nxt


def _posted_both(x: Collective, y: Collective, views: RankViews) -> list[int]:
    """The ranks that can have posted both: members of both groups (every rank where no dump
    lists the groups)."""
    for v in views.values():
        fr = v.ev.fr
        if fr is not None and x.pg in fr.pg_ranks and y.pg in fr.pg_ranks:
            both = set(fr.pg_ranks[x.pg]) & set(fr.pg_ranks[y.pg])
            return sorted(r for r in both if r in views)
    return sorted(views)


def swap_readings(x: Collective, y: Collective, views: RankViews) -> list[Reading]:
    """The ranks that posted both x and y, split by the order they posted them in: each side
    read as the one that swapped them (history: it broke the order every rank's earlier
    steps kept, while the other side kept it). Empty where no rank posted both."""
    kx, ky = (x.pg, x.seq), (y.pg, y.seq)
    cands = _posted_both(x, y, views)
    xy = [r for r in cands if _order_of(r, views, kx, ky) is True]
    yx = [r for r in cands if _order_of(r, views, kx, ky) is False]
    if not xy or not yx:
        return []
    follow = _followers(views)
    kept = {r: _keeps_history(r, views, x if r in xy else y, follow) for r in xy + yx}
    out = []
    for bad, good in ((xy, yx), (yx, xy)):
        broke = all(kept[r] is False for r in bad) and all(kept[r] is True for r in good)
        held = all(kept[r] is True for r in bad) and all(kept[r] is False for r in good)
        first = x if bad is xy else y
        out.append(Reading(tuple(bad), tuple(good), Edit.SWAP, mine=first,
                           theirs=y if first is x else x,
                           given={CulpritBasis.HISTORY: True if broke else False if held
                                  else None}))
    return out


def order_readings(ranks: Sequence[int], views: RankViews, program: Program
                   ) -> list[Reading]:
    """Each rank on a cycle, read as the one whose collective now is not what, in the agreed
    steps, followed the one it posted before it (its posting order, across groups) — while
    every other rank's is."""
    kept: dict[int, bool | None] = {}
    for r in ranks:
        cur = views[r].current
        prev = before(r, cur, views)
        kept[r] = program.follows(prev, cur, posted=True) if cur is not None else None
        if kept[r] is False and left_the_loop(prev, cur, views):
            # past the loop that posted the one before: what follows a loop was never seen
            # inside its steps (the barrier after training), which says nothing of an order
            kept[r] = None
    out = []
    for r in ranks:
        rest = tuple(q for q in ranks if q != r)
        broke = kept[r] is False and all(kept[q] is True for q in rest)
        held = kept[r] is True
        out.append(Reading((r,), rest, Edit.CHANGE, mine=views[r].current,
                           given={CulpritBasis.HISTORY: True if broke else False if held
                                  else None, CulpritBasis.MAJORITY: None,
                                  CulpritBasis.SOURCE: None,
                                  CulpritBasis.PROGRAM_ORDER: None}))
    return out


def inversion_of(reading: Reading, basis: CulpritBasis) -> Inversion | None:
    """The swap a decided reading names, as the summary tells it."""
    if reading.edit != Edit.SWAP or reading.mine is None or reading.theirs is None:
        return None
    return Inversion(reading.mine, reading.theirs, sorted(reading.culprits),
                     sorted(reading.others), basis)
