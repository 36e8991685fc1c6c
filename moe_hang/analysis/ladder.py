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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.gates import alike, went_through
from moe_hang.analysis.position import position_order, progress
from moe_hang.analysis.program import Program, fine_key
from moe_hang.analysis.program import same as same_collective
from moe_hang.analysis.rate import rate_vote
from moe_hang.analysis.source import (
    common_loop,
    every_pass,
    excludes_ranks,
    left_loop,
    path_condition,
    periodic_gate,
    taken_only_by,
)
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame
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
    if r.edit == Edit.BEHIND or _due_later(r, ctx):
        return None
    if _ends_a_run(r, p) or _past_the_loop(r, ctx):
        return None
    regular = [p.regular(c) for c in r.block] if r.realigned else []
    # every collective of the block regular (True) or never seen in a step (False)
    reg = regular[0] if regular and len(set(regular)) == 1 else None
    if reg and (got := _count_of_a_run(r, p)) is not None:
        return got
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


def _count_of_a_run(r: Reading, p: Program) -> bool | None:
    """A block the steps post several times running (an inner loop's collective): one
    fewer of it and one more read alike, and being regular says nothing — the step's count
    does: what the program posts at this seq (or, before two whole steps, the one period
    the whole agreed run is consistent with). None where neither says."""
    if r.mine is None or r.theirs is None or (r.mine.pg, r.mine.seq) != (
            r.theirs.pg, r.theirs.seq) or not any(p.follows(c, c) is True for c in r.block):
        return None
    exp = p.expected(r.theirs) or p.tentative(r.theirs)
    return _kept(same_collective(r.theirs, exp), same_collective(r.mine, exp)) \
        if exp is not None else None


def _due_later(r: Reading, ctx: Context) -> bool:
    """A collective of the reading that no agreed step posted, from a line under a test
    every rank decides alike in a pass on the loop's counter (``if step % 4 == 0:``): it
    comes due only at some passes, which the agreed steps need not have reached — what they
    always did says nothing of it (the ranks that disagree on it are in different passes)."""
    return any(
        c is not None and ctx.program.regular(c) is False
        and (site := callsite(list(c.frames))) is not None
        and periodic_gate(ctx.views.source, site.file, site.line) is not None
        for c in (*r.block, *(r.mines or (r.mine,)), r.theirs))


def _ends_a_run(r: Reading, p: Program) -> bool:
    """At one seq, one side went on with a collective the agreed steps posted several times
    running and never saw end, the other posted another op (what follows the run): one more
    of the run on one side and one fewer on the other read alike, and nothing the steps
    showed says where the run ends."""
    if r.edit != Edit.CHANGE or r.mine is None or r.theirs is None \
            or (r.mine.pg, r.mine.seq) != (r.theirs.pg, r.theirs.seq):
        return False  # a block's place, or another group's order, may still say
    # another op, not the run's own in another shape or from another line (a shape the
    # steps always kept, a line's place in the loop, decide those)
    return r.mine.op != r.theirs.op and any(p.endless(a) for a in (r.mine, r.theirs))


def _past_the_loop(r: Reading, ctx: Context) -> bool:
    """At one seq one side posted what no agreed step posted, from past the loop that holds
    the other side's (the barrier after training): where a loop ends is nothing the steps
    showed — one more pass on the other side, or one fewer on this."""
    if r.edit != Edit.CHANGE or r.mine is None or r.theirs is None \
            or (r.mine.pg, r.mine.seq) != (r.theirs.pg, r.theirs.seq):
        return False

    def line(c: Collective, at: tuple[Frame, ...]) -> Frame | None:
        return callsite(c.frames) if c.frames else at[-1] if at else None

    mine, theirs = line(r.mine, r.at_mine), line(r.theirs, r.at_theirs)
    # each side's line: what posted it, else where the rank is; past every loop that holds
    # the other's (an inner loop is left every pass: the steps saw what follows it)
    src = ctx.views.source
    return any(ctx.program.regular(c) is False and _past_loop(src, a, b)
               and common_loop(src, a.file, a.line, b.line) is None
               for c, a, b in ((r.mine, mine, theirs), (r.theirs, theirs, mine))
               if a is not None and b is not None)


def left_the_loop(prev: Collective | None, cur: Collective | None, views: RankViews) -> bool:
    """The source says ``cur``'s line is past a loop that holds ``prev``'s (the rank left
    the loop between the two)."""
    return _past_loop(views.source, callsite(cur.frames) if cur is not None and cur.frames
                     else None, callsite(prev.frames) if prev is not None and prev.frames
                     else None)


def _past_loop(src: SourceFacts, a: Frame | None, b: Frame | None) -> bool:
    """Line ``a`` is past a loop that holds line ``b`` (one file)."""
    return a is not None and b is not None and a.file == b.file \
        and left_loop(src, a.file, a.line, b.line) is not None


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
        ahead = position_order(ctx.views.source, fa, fb, ca, cb) if fa and fb else None
        if ahead is not None and _numbered(ctx, r, fa, fb, ahead):
            ahead = None
        answers.append(None if ahead is None else (not ahead) if r.edit == Edit.BEHIND
                       else ahead)
    if any(a is False for a in answers):
        return False
    if answers and all(a is True for a in answers):
        return True
    # the lines tie (or are not known): the order the agreed run's one step, seen once and
    # begun again, says the program posts at this seq
    exp = ctx.program.tentative(r.theirs) if not _ends_a_run(r, ctx.program) else None
    if exp is not None and r.mine is not None and r.theirs is not None \
            and r.edit in (Edit.SKIP, Edit.CHANGE) \
            and (r.mine.pg, r.mine.seq) == (r.theirs.pg, r.theirs.seq):
        ok_theirs, ok_mine = same_collective(r.theirs, exp), same_collective(r.mine, exp)
        if ok_theirs != ok_mine:
            return ok_theirs
    return None


def _numbered(ctx: Context, r: Reading, fa: list[Frame], fb: list[Frame], ahead: bool
              ) -> bool:
    """The side further along went through the other's line: it posted that collective
    itself, numbered, and being further along says nothing of a skip. A skip's culprit ahead
    (:func:`.gates.went_through`); at one position where the recorder numbers both, either
    side ahead — later in the pass or a lap on, through a line every pass posts — where the
    counts decide (:mod:`.shift`). From stacks alone a rank past a line may have posted it
    on another group, and the later line is the order known."""
    if r.edit == Edit.SKIP and ahead:
        return went_through(ctx.views.source, fa, fb, r.mine,
                            [ctx.views[o].tl.enqueued for o in r.others])
    numbered = r.mine is not None and r.theirs is not None and None not in (
        r.mine.seq, r.theirs.seq)
    fx, fy = (fa, fb) if ahead else (fb, fa)
    return r.edit == Edit.CHANGE and numbered and alike(fx, fy) \
        and every_pass(ctx.views.source, fy[-1], fx[-1])


LADDER: tuple[tuple[CulpritBasis, Rung], ...] = (
    (CulpritBasis.HISTORY, history),
    (CulpritBasis.MAJORITY, majority),
    (CulpritBasis.SOURCE, source),
    (CulpritBasis.PROGRAM_ORDER, program_order),
)

# a reading whose ranks the ladder already weighed on the evidence itself (a cycle, the
# roots the ranks name): only the counts are left to weigh
COUNTS_ONLY: dict[CulpritBasis, bool | None] = {
    CulpritBasis.HISTORY: None, CulpritBasis.SOURCE: None, CulpritBasis.PROGRAM_ORDER: None}


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
