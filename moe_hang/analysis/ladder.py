"""Who deviated: the one decision every divergence goes through (docs/DESIGN.md §8.5) — pure.

A divergence has *readings*: each says which ranks deviated from the program the others
followed, and how (an edit: they skipped a block, posted an extra one, posted a different
collective, swapped two, used another group, or — a member absent — are only held up before
it). The readings of one divergence are weighed by one ladder of evidence, strongest first;
the first rung that singles out one reading decides, and names itself as the basis:

1. ``history`` — the program the ranks agreed on (:mod:`.program`): the reading whose
   culprits broke what always followed, or the shape a collective always had, while the
   others kept it; on a helper thread's group, the one-per-lap rate its collectives kept
   against the main loop on every rank (:mod:`.rate`);
2. ``majority`` — its culprits are a strict minority of the ranks that posted there;
3. ``source`` — a rank condition in the source (``if rank == 0:``) puts the culprits' own
   collective in a branch only they take, or leaves out the one they lack;
4. ``program_order`` — the culprits' line comes after the others' within one iteration (never
   a skip of a line every pass posts: :func:`.gates.went_through`), or the probe's step/tag.

Where no rung singles one out, the verdict names every candidate (``ambiguous``). Never by rank
number or dict order. Byte counts are not a rung: they are what places a rank gloo aborted
(:mod:`.reconcile`), before any reading is made.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.gates import every_pass, went_through
from moe_hang.analysis.program import Program, fine_key
from moe_hang.analysis.program import same as same_collective
from moe_hang.analysis.rate import rate_vote
from moe_hang.analysis.source import (
    Order,
    enclosing_loop,
    excludes_ranks,
    function_step,
    in_loop,
    loop_step,
    order,
    path_condition,
    taken_only_by,
)
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame, is_library_frame
from moe_hang.evidence.vocab import StrEnum


class Edit(StrEnum):
    SKIP = "skip"  # the culprits lack ``block``, which the others posted
    EXTRA = "extra"  # the culprits posted ``block``, which the others never did
    CHANGE = "change"  # at one position the culprits posted ``mine``, the others ``theirs``
    SWAP = "swap"  # the culprits posted two collectives in the other order
    GROUP = "group"  # the culprits posted it on another group
    BEHIND = "behind"  # the culprits never got to it: held up earlier (a consequence)


@dataclass(frozen=True)
class Reading:
    """One explanation of a divergence: ``culprits`` deviated from what ``others`` did."""

    culprits: tuple[int, ...]
    others: tuple[int, ...]
    edit: Edit
    mine: Collective | None = None  # the culprits' first collective where they deviate
    theirs: Collective | None = None  # the others' collective there (the program's)
    prev: Collective | None = None  # the last collective both sides agreed on before it
    # where the two sides came to it from different places (a rank absent from a group's
    # collective: what it posted before its own, on any group): the others' predecessor
    prev_theirs: Collective | None = None
    # ``prev`` is what each side posted right before, on any group (its posting order), not
    # the group's previous seq
    posted_order: bool = False
    block: tuple[Collective, ...] = ()  # SKIP: what the culprits lack; EXTRA: what they added
    # the two sides' sequences line up again after the block (a diff): what the block is in
    # the program (regular or never seen) then tells a skip from an extra — for a rank only
    # absent, it may as well be behind
    realigned: bool = False
    # where each side is, user frames outermost first (its stack, else what it posted)
    at_mine: tuple[Frame, ...] = ()
    at_theirs: tuple[Frame, ...] = ()
    # every culprit camp's first collective where it deviates (``mine`` is the first's),
    # and where each camp is (``at_mine`` is the first's)
    mines: tuple[Collective, ...] = ()
    at_mines: tuple[tuple[Frame, ...], ...] = ()
    # an answer some evidence gives outright for a rung (the probe's step order, the order
    # ranks posted two groups' collectives in): basis -> True / False / None (it abstains)
    given: dict[CulpritBasis, bool | None] = field(default_factory=dict, hash=False,
                                                   compare=False)


@dataclass(frozen=True)
class Decision:
    culprits: list[int]
    basis: CulpritBasis
    reading: Reading | None  # the reading chosen (None: ambiguous)


@dataclass(frozen=True)
class Context:
    views: RankViews
    program: Program


Rung = Callable[[Reading, Context], bool | None]
_FOR = re.compile(r"^(?:async\s+)?for\s+(.+?)\s+in\s")


def _frames(c: Collective | None) -> list[Frame]:
    return list(c.frames) if c is not None else []


def _condition(ctx: Context, frames: Sequence[Frame]) -> str | None:
    return path_condition(ctx.views.source, list(frames)) if frames else None


def history(r: Reading, ctx: Context) -> bool | None:
    """The culprits broke what the agreed steps always did, the others kept it."""
    if r.given.get(CulpritBasis.HISTORY) is not None:
        return r.given[CulpritBasis.HISTORY]
    if r.edit in (Edit.SKIP, Edit.EXTRA) and r.block and r.culprits and r.others:
        # a helper thread's group, where the steps cannot tell (a loop over a queue ends
        # when it ends): the one-per-lap rate it kept on every rank (.rate)
        vote = rate_vote(r.culprits, r.others, r.block[0].pg, ctx.views)
        if vote is not None:
            return vote
    if CulpritBasis.HISTORY in r.given:
        return None
    p = ctx.program
    if r.edit == Edit.BEHIND:
        return None
    regular = [p.regular(c) for c in r.block] if r.realigned else []
    # every collective of the block regular (True) or never seen in a step (False)
    reg = regular[0] if regular and len(set(regular)) == 1 else None
    if r.edit == Edit.EXTRA and reg is not None:
        # an extra is what no agreed step ever posted (a block every step posts is not one)
        return not reg
    # the program's own step: what it posts at this seq, a step on from the agreed run
    exp = p.expected(r.theirs)
    if exp is not None and r.mine is not None and r.theirs is not None \
            and (r.mine.pg, r.mine.seq) == (r.theirs.pg, r.theirs.seq) \
            and (got := _kept(same_collective(r.theirs, exp),
                              same_collective(r.mine, exp))) is not None:
        return got
    mines = r.mines or ((r.mine,) if r.mine is not None else ())
    follow = [p.follows(r.prev, m, r.posted_order) for m in mines]
    mine = (False if follow and all(x is False for x in follow)
            else True if any(x is True for x in follow) else None)
    theirs = p.follows(r.prev_theirs or r.prev, r.theirs, r.posted_order)
    fm = fine_key(r.mine) if r.mine is not None else None
    one_path = fm is not None and r.theirs is not None and fm == fine_key(r.theirs)
    # what always followed: the others' next kept it, the culprits' broke it
    if not one_path and (got := _kept(theirs, mine)) is not None:
        return got
    if r.edit == Edit.SKIP and reg is not None:
        return reg  # a regular part of every step: its absence is the skip
    if r.mine is not None and r.theirs is not None and r.mine.op == r.theirs.op:
        # one collective, two shapes: the side that kept the shape it always had is right
        return _kept(p.keeps_shape(r.theirs), p.keeps_shape(r.mine))
    return None


def _kept(theirs: bool | None, mine: bool | None) -> bool | None:
    """The others kept what the program did and the culprits broke it (True), or the other
    way round (False); else nothing."""
    return theirs if theirs is not None and mine is not None and theirs != mine else None


def majority(r: Reading, ctx: Context) -> bool | None:
    """The culprits are a strict minority of the ranks the divergence involves."""
    if CulpritBasis.MAJORITY in r.given:
        return r.given[CulpritBasis.MAJORITY]
    if not r.others or r.edit == Edit.BEHIND or len(r.culprits) == len(r.others):
        return None  # as many on each side: a count says nothing
    return len(r.culprits) < len(r.others)


def source(r: Reading, ctx: Context) -> bool | None:
    """A rank condition in the source: a block under a condition that names who runs it
    (``if rank == 0:``) is those ranks' extra; under one that names who does not (``if rank
    != 3:``, an ``else``) it is the skip of the ranks it leaves out. At one position: the
    side whose own collective runs in a branch only it takes deviated."""
    if CulpritBasis.SOURCE in r.given:
        return r.given[CulpritBasis.SOURCE]
    if r.edit == Edit.BEHIND:
        return None
    if r.edit in (Edit.SKIP, Edit.EXTRA) and r.block:
        cond = _condition(ctx, _frames(r.block[0]) or
                          (r.at_theirs if r.edit == Edit.SKIP else r.at_mine))
        runners, rest = (r.others, r.culprits) if r.edit == Edit.SKIP else (r.culprits, r.others)
        if cond is None or not taken_only_by(cond, runners, rest):
            return None  # none, or one that the ranks' own numbers contradict
        excludes = excludes_ranks(cond)
        return excludes if r.edit == Edit.SKIP else not excludes
    cond_mine = _condition(ctx, _frames(r.mine) or r.at_mine)
    cond_theirs = _condition(ctx, _frames(r.theirs) or r.at_theirs)
    took = cond_mine is not None and not excludes_ranks(cond_mine) and \
        taken_only_by(cond_mine, r.culprits, r.others)
    other_took = cond_theirs is not None and not excludes_ranks(cond_theirs) and \
        taken_only_by(cond_theirs, r.others, r.culprits)
    if took and not other_took:
        return True  # only the culprits take the branch their collective is in
    if other_took and not took:
        return False
    # a branch that leaves ranks out (``if rank != 3``, ``if not (rank == r and ...)``)
    # around one side's collective, none around the other's: the side at the collective
    # every rank posts is the one left out of the other
    if cond_mine is None and cond_theirs is not None and excludes_ranks(cond_theirs):
        return True
    if cond_theirs is None and cond_mine is not None and excludes_ranks(cond_mine):
        return False
    return None


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


def position_order(ctx: Context, fa: Sequence[Frame], fb: Sequence[Frame],
                   pa: Progress | None = None, pb: Progress | None = None) -> bool | None:
    """Is ``fa`` (user frames outermost first) further along than ``fb``: at the deepest
    frame both share, the later statement. Where a loop repeats both lines (a loop holding
    them, or one around a frame they share), either may be ahead: the later line within one
    iteration (it skipped what lies between), or the earlier one a lap on (it skipped what
    lies from the later line round to it) — the reading that skips fewer of the collectives
    the source shows there wins (gloo stops a rank at the first collective it cannot
    complete, so a rank that lapped the other skipped every one on its way); None where
    they tie or nothing is known."""
    src = ctx.views.source
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


def program_order(r: Reading, ctx: Context) -> bool | None:
    """The culprits went past the others' collective (a later line in one pass), or behind."""
    if CulpritBasis.PROGRAM_ORDER in r.given:
        return r.given[CulpritBasis.PROGRAM_ORDER]
    if r.edit in (Edit.EXTRA, Edit.SWAP, Edit.GROUP):
        return None
    fb = [f for f in r.at_theirs if not is_library_frame(f)]
    ca, cb = progress(ctx.views, r.culprits), progress(ctx.views, r.others)
    answers = []
    for at_mine in r.at_mines or (r.at_mine,):  # every culprit camp past the others
        fa = [f for f in at_mine if not is_library_frame(f)]
        ahead = position_order(ctx, fa, fb, ca, cb) if fa and fb else None
        if ahead and r.edit == Edit.SKIP and went_through(  # then it posted it, numbered
                ctx.views.source, fa, fb, r.mine, [ctx.views[o].tl.enqueued for o in r.others]):
            ahead = None
        answers.append(None if ahead is None else (not ahead) if r.edit == Edit.BEHIND
                       else ahead)
    if any(a is False for a in answers):
        return False
    if answers and all(a is True for a in answers):
        return True
    # the lines tie (or are not known): the order the agreed run's one step, seen once and
    # begun again, says the program posts at this seq
    exp = ctx.program.tentative(r.theirs)
    if exp is not None and r.mine is not None and r.theirs is not None \
            and r.edit in (Edit.SKIP, Edit.CHANGE) \
            and (r.mine.pg, r.mine.seq) == (r.theirs.pg, r.theirs.seq):
        ok_theirs, ok_mine = same_collective(r.theirs, exp), same_collective(r.mine, exp)
        if ok_theirs != ok_mine:
            return ok_theirs
    return None


LADDER: tuple[tuple[CulpritBasis, Rung], ...] = (
    (CulpritBasis.HISTORY, history),
    (CulpritBasis.MAJORITY, majority),
    (CulpritBasis.SOURCE, source),
    (CulpritBasis.PROGRAM_ORDER, program_order),
)


def decide(readings: Sequence[Reading], ctx: Context) -> Decision:
    """Rung by rung, strongest first: a rung that says yes to one reading still standing and
    to no other decides; a reading it says no to is out (unless it would say no to all).
    Where no rung decides, every candidate is named."""
    alive = list(readings)
    for basis, rung in LADDER:
        votes = [rung(r, ctx) for r in alive]
        yes = [r for r, v in zip(alive, votes, strict=True) if v is True]
        if yes and len({r.culprits for r in yes}) == 1:
            # one reading, or several that blame the same ranks (a skip of one collective
            # and an extra of the next read the same two sequences): the first says how
            return Decision(sorted(yes[0].culprits), basis, yes[0])
        left = [r for r, v in zip(alive, votes, strict=True) if v is not False]
        if left and len(left) < len(alive):
            alive = left
            if len(alive) == 1:
                return Decision(sorted(alive[0].culprits), basis, alive[0])
    named = sorted({c for r in alive if r.edit != Edit.BEHIND for c in r.culprits})
    return Decision(named, CulpritBasis.AMBIGUOUS, None)
