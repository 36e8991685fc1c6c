"""Where two ranks are against each other in the code (docs/DESIGN.md §8.5, the
``program_order`` rung): the later statement within one pass of a loop, or the earlier one a
lap on — by py-spy's loop counters, the recorders' posts per line, and the collectives the
source shows between the two lines. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from moe_hang.analysis.source import (
    Order,
    enclosing_loop,
    every_pass,
    function_step,
    in_loop,
    loop_step,
    on_every_rank,
    order,
)
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame

_FOR = re.compile(r"^(?:async\s+)?for\s+(.+?)\s+in\s")


Counters = Mapping[Frame, Mapping[str, int]]
Posts = Mapping[tuple[str, int], Mapping[str, int]]


@dataclass(frozen=True)
class Progress:
    """How far one camp has got round its loops: py-spy's integer loop counters per frame,
    and the latest seq its recorder holds posted from each line of the job."""

    counters: Counters = field(default_factory=dict)
    posts: Posts = field(default_factory=dict)


def progress(views: RankViews, ranks: Sequence[int]) -> Progress:
    """The first of ``ranks``' progress (its camp's: one line, one iteration)."""
    v = views.get(ranks[0]) if ranks else None
    if v is None:
        return Progress()
    return Progress(v.stack.counters, views.latest_posts(ranks[0]))


def _lapped(calls: Sequence[int], file: str, first: int, later: int, p_later: Posts,
            p_first: Posts, sure: frozenset[int]) -> bool | None:
    """From what the recorders hold: is the rank at the loop's earlier line a lap on (True)
    or in the rank at the later line's iteration (False)? Every line of the loop both posted
    from votes: in one iteration the later rank alone has posted from the lines up to its
    own since, and neither from the rest; a lap on, the earlier rank alone has posted from
    the rest, and both as often from the lines between. The edit (what one of them skipped)
    spoils a vote or two; None where the votes tie. One vote alone decides only from a line
    every pass posts (``sure``): one a branch may skip may be the edit's own line."""
    same = lap = 0
    voters: set[int] = set()
    # the edit's own line is left out: what it says depends on the edit
    for c in (set(calls) | {later}) - {first}:
        a, b = p_later.get((file, c), {}), p_first.get((file, c), {})
        between = first < c <= later
        for g in a.keys() & b.keys():
            voters.add(c)
            if between:
                same, lap = same + (a[g] > b[g]), lap + (a[g] == b[g])
            else:
                same, lap = same + (a[g] == b[g]), lap + (a[g] < b[g])
    return None if same == lap or (same + lap < 2 and not voters <= sure) else lap > same


def _iteration(header: str | None, x: Frame, y: Frame, ca: Counters, cb: Counters
               ) -> int | None:
    """Two ranks' frames in one ``for`` loop (``header``), by the loop's integer counters
    py-spy showed: 1 where ``x``'s iteration is the later, -1 where ``y``'s is, 0 where
    every counter both show is equal; None where none is known."""
    m = _FOR.match(header or "")
    if m is None:
        return None
    va, vb = ca.get(x, {}), cb.get(y, {})
    names = [n for n in re.findall(r"[A-Za-z_]\w*", m.group(1)) if n in va and n in vb]
    for name in names:
        if va[name] != vb[name]:
            return 1 if va[name] > vb[name] else -1
    return 0 if names else None


def position_order(src: SourceFacts, fa: Sequence[Frame], fb: Sequence[Frame],
                   pa: Progress | None = None, pb: Progress | None = None) -> bool | None:
    """Is ``fa`` (user frames outermost first) further along than ``fb``: at the deepest
    frame both share, the later statement. Where a loop repeats both lines (a loop holding
    them, or one around a frame they share), either may be ahead: the later line within one
    iteration (it skipped what lies between), or the earlier one a lap on (it skipped what
    lies from the later line round to it) — the reading that skips fewer of the collectives
    the source shows there wins (gloo stops a rank at the first collective it cannot
    complete, so a rank that lapped the other skipped every one on its way); None where
    they tie or nothing is known."""
    pa, pb = pa or Progress(), pb or Progress()
    ca, cb = pa.counters, pb.counters
    repeated = False
    for x, y in zip(fa, fb, strict=False):
        if (x.file, x.function) != (y.file, y.function):
            return None
        if x.line == y.line:
            # one line in a loop: its counters (py-spy's locals) say whether they are in
            # one iteration or which is the later
            it = _iteration(enclosing_loop(src, x.file, x.line), x, y, ca, cb)
            if it:
                return it > 0
            repeated = repeated or (in_loop(src, x.file, x.line) and it != 0)
            continue
        o = order(src, x.file, x.line, y.line)
        if o not in (Order.A_FIRST, Order.B_FIRST):
            return None
        x_later = o is Order.B_FIRST
        region = loop_step(src, x.file, x.line, y.line)
        if region is not None and not repeated:
            it = _iteration(region.header, x, y, ca, cb)
            if it:
                return it > 0
            if it == 0:
                return x_later  # one iteration of the loop holding both: the later line
            first, later = (y.line, x.line) if x_later else (x.line, y.line)
            p_later, p_first = (pa.posts, pb.posts) if x_later else (pb.posts, pa.posts)
            at = Frame(x.file, first, x.function)
            sure = frozenset(c for c in {*region.calls, later}
                             if every_pass(src, replace(at, line=c), at))
            lapped = _lapped(region.calls, x.file, first, later, p_later, p_first, sure)
            if lapped is not None:
                return x_later != lapped
        if region is None and not repeated:
            return x_later  # within one run of this code: the later line is ahead
        if region is None:
            region = function_step(src, x.file, x.line)
        if region is None:
            return None
        first, later = (y.line, x.line) if x_later else (x.line, y.line)
        within = {first} | {c for c in region.calls if first < c < later}
        lap = {later} | {c for c in region.calls if c > later or c < first}
        if len(within) == len(lap):
            return None
        later_ahead = len(within) < len(lap)
        return x_later if later_ahead else not x_later
    return None


def pass_on(src: SourceFacts, fr: Sequence[Frame], op: str, fq: Sequence[Frame]
            ) -> bool | None:
    """A rank waiting in a point-to-point ``op`` (at ``fr[-1]``, user frames outermost first)
    for a peer at ``fq``, both in one loop: is the rank a pass on from its peer (True), or
    in the peer's pass (False)? The peer owes the op that answers it (a recv answers a
    send), which the loop's body calls from one line. Not yet there, the peer is in the
    rank's pass: a pass behind, it would not have answered the rank's op of that pass.
    Past it, the peer answered — gloo completes a send or a recv only once the peer posts
    its answer — unless it skipped the answer in the rank's pass: a collective every rank
    posts every pass, between the rank's line and the peer's, says it did not (the rank has
    not posted it, so the peer got there a pass earlier). None where the source does not
    say."""
    if not fr or len(fq) < len(fr) or any(
            (x.file, x.function, x.line) != (y.file, y.function, y.line)
            for x, y in zip(fr[:-1], fq, strict=False)):
        return None
    x, y = fr[-1], fq[len(fr) - 1]
    region = loop_step(src, x.file, x.line, y.line) if x.function == y.function else None
    if region is None or (x.line, op) not in region.p2p:
        return None
    answers = [n for n, o in region.p2p if o == ("recv" if op == "send" else "send")]
    if len(answers) != 1:
        return None
    owed = _owed_between(src, x, y.line, region.calls)
    if order(src, x.file, y.line, answers[0]) in (Order.A_FIRST, Order.SAME):
        # not yet at its answer: the rank's pass — unless the peer went past a collective
        # every rank owes that the rank has not reached, which no one pass allows
        return None if owed else False
    if order(src, x.file, answers[0], y.line) is not Order.A_FIRST:
        return None
    return True if owed else None


def _owed_between(src: SourceFacts, x: Frame, later: int, calls: Sequence[int]) -> bool:
    """A collective every rank posts every pass at a line after ``x``'s and before
    ``later`` (one iteration of the loop holding both)."""
    return any(order(src, x.file, x.line, c) is Order.A_FIRST
               and order(src, x.file, c, later) is Order.A_FIRST
               and on_every_rank(src, x.file, c) is True
               and every_pass(src, replace(x, line=c), x) for c in calls)


def passes_from_peers(views: RankViews, owed: Mapping[int, int]
                      ) -> dict[int, tuple[int, int]] | None:
    """Ranks waiting in a send or a recv (``owed``: the peer each waits for), followed peer to
    peer (a pipeline stalls stage by stage) to the one rank they all wait on, not itself in
    one: each rank's passes on from it, by :func:`pass_on` at every step of the way. None
    where a step is not known, the chain loops, or they wait on more than one rank."""
    out: dict[int, tuple[int, int]] = {}
    for r in owed:
        seen, at, laps = {r}, r, 0
        while at in owed:
            q = owed[at]
            p2p = views[at].stack.p2p
            step = pass_on(views.source, views[at].user_frames_outer_first(),
                           p2p.op if p2p is not None else "",
                           views[q].user_frames_outer_first()) if q in views else None
            if step is None or q in seen:
                return None
            seen.add(q)
            at, laps = q, laps + int(step)
        out[r] = (at, laps)
    return out if len({root for root, _ in out.values()}) == 1 else None
