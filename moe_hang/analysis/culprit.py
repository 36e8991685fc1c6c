"""Who is to blame for each divergence: its readings (:mod:`.readings`), weighed by the one
ladder (:func:`.ladder.decide`; docs/DESIGN.md §8.5). Never by rank number or dict order.
Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from moe_hang.analysis.align import GroupDivergence
from moe_hang.analysis.blocks import EXTRA, SKIP, Block, taken_branch
from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, MismatchKind, RankCollective
from moe_hang.analysis.ladder import Context, Decision, Edit, Reading, decide
from moe_hang.analysis.mismatch import ROW
from moe_hang.analysis.readings import (
    Inversion,
    absent_readings,
    at,
    block_readings,
    camp_readings,
    extra_reading,
    inversion_of,
    order_readings,
    swap_readings,
    user_frames,
)
from moe_hang.analysis.shift import Shift, divergence_shifts
from moe_hang.analysis.source import excludes_ranks, path_condition
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.analysis.waitfor import Edge
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import SizeAbort
from moe_hang.evidence.ops import nbytes
from moe_hang.evidence.stacks import Frame


@dataclass
class Blame:
    culprits: list[int]
    basis: CulpritBasis
    confirmed: bool = True  # False: likely only (an inferred side)
    causal: bool = True  # False: its absent ranks are held up elsewhere (a consequence)
    reading: Reading | None = None  # the reading the ladder chose
    shift: Shift | None = None  # the count shift whose reading it chose


def _blame(d: Decision) -> Blame:
    return Blame(d.culprits, d.basis, reading=d.reading)


def _sides(items: dict[int, object]) -> list[list[int]]:
    groups: dict[object, list[int]] = {}
    for r, key in sorted(items.items()):
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _tag_ahead(g: GroupDivergence, views: RankViews) -> list[int] | None:
    """Probe tags (layer1.expert2): the rank whose collective here is the one the others post
    *next* is ahead by one: it skipped the one in between."""
    pg, seq = g.div.pg, g.div.seq or 0
    tags = {r: c.tag for r, c in g.have.items() if c.tag}
    ahead = [r for r, tag in tags.items()
             if any(q != r and tags[q] != tag
                    and (nxt := views[q].tl.by_pg.get(pg, {}).get(seq + 1)) is not None
                    and nxt.tag == tag for q in tags)]
    return sorted(ahead) or None


def _unknown_shape(c: Collective) -> bool:
    return c.source == "reconciled" and not c.input_sizes and not c.dtypes


def blame(g: GroupDivergence, ctx: Context) -> Blame:
    """The culprits of one group's divergence."""
    views = ctx.views
    if g.div.kind == MismatchKind.MISSING and g.absent:
        return _blame_absent(g, ctx)
    if g.blocks:  # one side posted collectives the other did not
        d = decide(block_readings(g.div.pg, g.blocks, views), ctx)
        g.block = _chosen(g.blocks, d, views)
        b = _blame(d)
        # a block of one collective alike the ones before it may sit anywhere in their run:
        # a shift at a camp's line read the same way (the same edit by the same ranks) says
        # where the source puts it
        if (read := d.reading) is not None:
            b.shift = next((replace(sh, decision=replace(d, reading=x))
                            for sh in divergence_shifts(g.have, ctx) if sh.same_seq
                            for x in sh.readings
                            if x.edit == read.edit and x.culprits == read.culprits), None)
        return b
    if g.identity:
        sides = _sides(g.identity)
    else:
        same = ROW[g.div.kind].same
        reps: list[tuple[Collective, list[int]]] = []
        for r, c in sorted(g.have.items()):
            for rep, rs in reps:
                if same(rep, c):
                    rs.append(r)
                    break
            else:
                reps.append((c, [r]))
        sides = [rs for _, rs in reps]
        if g.div.kind in (MismatchKind.SIZE, MismatchKind.DTYPE):
            # a rank gloo aborted, placed here by its peers (reconcile) with nothing of its
            # own tensor known, is no camp of its own: it would make the one rank that
            # differs look like half a tie
            known = [rs for rs in sides if not all(_unknown_shape(g.have[r]) for r in rs)]
            if known and len(known) < len(sides):
                sides = known
    entries: dict[int, Collective | None] = dict(g.have)
    readings = camp_readings(g.div.pg, g.div.seq, sides, entries, views)
    tagged = _tag_ahead(g, views) if g.identity else None
    if tagged is not None:
        readings = [replace(r, given={**r.given, CulpritBasis.PROGRAM_ORDER:
                                      sorted(r.culprits) == tagged}) for r in readings]
    shifts = divergence_shifts(entries, ctx)
    # a shift whose passed side is a camp here says why the camps differ: it goes first
    first = [x for sh in shifts if sh.same_seq for x in sh.readings]
    if first:
        # and a camp past the other's line posted that line's collective itself: its being
        # further along says nothing of a skip
        readings = [r if CulpritBasis.PROGRAM_ORDER in r.given else replace(
            r, given={**r.given, CulpritBasis.PROGRAM_ORDER: None}) for r in readings]
    d = decide([*first, *readings, *(x for sh in shifts if not sh.same_seq
                                      for x in sh.readings)], ctx)
    b = _blame(d)
    # (or one of whose readings blames the ranks the decision does: it says why)
    b.shift = next((replace(sh, decision=d) for sh in shifts
                    if any(d.reading is x for x in sh.readings)), None) or next((
        replace(sh, decision=replace(d, reading=x)) for sh in shifts if sh.same_seq
        for x in sh.readings if sorted(x.culprits) == d.culprits), None)
    return b


def _chosen(blocks: tuple[Block, ...], d: Decision, views: RankViews) -> Block:
    """The block the decision read, marked with how it was read (else the first, undecided)."""
    r = d.reading
    if r is not None:
        for b in blocks:
            if r.edit == Edit.EXTRA and tuple(b.having) == r.culprits and \
                    tuple(b.items) == r.block:
                b.decided, b.basis = EXTRA, d.basis
                # the rank condition it runs under, where the source names one; else the
                # branch its line sits in (a data decision)
                cond = path_condition(views.source, b.items[0].frames) if b.items else None
                if cond is not None and not excludes_ranks(cond):
                    b.condition = cond
                elif b.items and b.condition is None:
                    b.condition = taken_branch(views.source, b.items[0].frames)
                    b.data_branch = b.condition is not None
                return b
            if r.edit == Edit.SKIP and tuple(b.lacking) == r.culprits and \
                    tuple(b.items) == r.block:
                b.decided, b.basis = SKIP, d.basis
                return b
    b = blocks[0]
    b.decided, b.basis = None, CulpritBasis.AMBIGUOUS
    return b


def _blame_absent(g: GroupDivergence, ctx: Context) -> Blame:
    """Members that never posted it: each went past it (a culprit), or is held up before it
    (this divergence is then a consequence) — unless what the others wait in is an extra of
    theirs."""
    views = ctx.views
    waiter = next((r for r, c in g.have.items() if c.completed is not True), next(iter(g.have)))
    waiting = g.have[waiter]
    waiters = sorted(g.have)
    extra = extra_reading(waiting, waiters, g.absent, views)
    ahead: list[int] = []
    behind: list[int] = []
    bases: list[Decision] = []
    for a in g.absent:
        d = decide([extra, *absent_readings(waiting, waiters, a, views)], ctx)
        if d.reading is extra:
            return _blame(d)
        if d.reading is not None and d.reading.edit == Edit.SKIP:
            ahead.append(a)
            bases.append(d)
        elif d.reading is not None and d.reading.edit == Edit.BEHIND:
            behind.append(a)
    if ahead:
        return Blame(sorted(ahead), bases[0].basis, reading=bases[0].reading)
    if behind and len(behind) == len(g.absent):
        return Blame(sorted(behind), CulpritBasis.PROGRAM_ORDER, causal=False)
    return Blame(sorted(g.absent), CulpritBasis.AMBIGUOUS)


def posting_path(c: Collective, v: RankView) -> list[Frame]:
    """The user path that posted ``c``: the recorder's frames, else the stack of the rank
    still blocked in it."""
    if c.frames or c.completed is not False or v.stack.op != c.op:
        return list(c.frames)
    return list(v.stack.frames)


def condition_on(c: Collective, v: RankView, views: RankViews) -> str | None:
    """The rank condition on the user path that posted ``c``."""
    return path_condition(views.source, posting_path(c, v))


# ------------------------------------------------------------------------------ cycles


def _stand_in(rank: int, views: RankViews) -> Collective:
    """A placeholder for where a rank waits in a point-to-point call (its position)."""
    return Collective(pg="p2p", seq=-1, op=views[rank].stack.op or "p2p", frames=[])


def blame_cycle(cycle: list[Edge], ctx: Context, redirected: Sequence[int] = ()) -> Blame:
    """On a wait-for cycle: per edge, the rank waited on went past what its waiter waits in,
    or what the waiter waits in is its own extra, or — two groups' collectives the ranks
    posted in opposite orders — one side swapped them, or ``redirected`` ranks posted a
    collective on another group than every earlier call of its line (wronggroup.py); where
    nothing decides, every rank on the cycle."""
    views = ctx.views
    ranks = sorted({e.waiter for e in cycle})
    # the most specific first: where several name the same ranks, the first says how
    swaps = [Reading(tuple(sorted(redirected)), tuple(r for r in ranks if r not in redirected),
                     Edit.GROUP, given={CulpritBasis.HISTORY: True})] if redirected else []
    swaps += _swap_readings(cycle, views) + order_readings(ranks, views, ctx.program)
    culprits: set[int] = set()
    decisions: list[Decision] = []
    for e in cycle:
        target = e.coll if e.coll is not None else _stand_in(e.waiter, views)
        extra = extra_reading(target, [e.waiter], [e.on], views) if e.coll is not None else None
        cands = [*([extra] if extra is not None else []),
                 *absent_readings(target, [e.waiter], e.on, views)]
        if e.coll is None:  # a send it owes: no branch of the waiter's says anything of it
            cands = [replace(c, given={**c.given, CulpritBasis.SOURCE: None}) for c in cands]
        d = decide([*swaps, *cands], ctx)
        if d.reading is not None and d.reading.edit == Edit.SWAP:
            inv = inversion_of(d.reading, d.basis)
            if inv is not None:
                return Blame(inv.culprits, inv.basis, reading=d.reading)
        if d.reading is not None and d.reading in swaps:  # its own order, or group, broken
            return Blame(d.culprits, d.basis, reading=d.reading)
        if d.reading is not None and d.reading.edit in (Edit.SKIP, Edit.EXTRA):
            culprits.update(d.culprits)
            decisions.append(d)
    if culprits and len(culprits) < len(ranks):
        first = decisions[0]
        return Blame(sorted(culprits), first.basis, reading=first.reading)
    inv = cycle_inversion(cycle, ctx)
    if inv is not None:
        return Blame(inv.culprits, inv.basis)
    return Blame(ranks, CulpritBasis.CYCLE)


def _swap_readings(cycle: list[Edge], views: RankViews) -> list[Reading]:
    """The two groups' collectives on the cycle, read as swapped by either side."""
    colls = {(e.coll.pg, e.coll.seq): e.coll for e in cycle if e.coll is not None}
    if len(colls) != 2:
        return []
    x, y = colls.values()
    return swap_readings(x, y, views) if x.pg != y.pg else []


def cycle_inversion(cycle: list[Edge], ctx: Context) -> Inversion | None:
    """A cycle through two collectives of different groups that its ranks posted in opposite
    orders (every one posted both: NCCL enqueues without waiting), and the side the ladder
    names as the one that swapped them."""
    colls = {(e.coll.pg, e.coll.seq): e.coll for e in cycle if e.coll is not None}
    if len(colls) != 2:
        return None
    x, y = colls.values()
    if x.pg == y.pg:
        return None
    question = ("swap", x.pg, x.seq, y.pg, y.seq)
    if question not in ctx.views.memo:
        readings = swap_readings(x, y, ctx.views)
        d = decide(readings, ctx) if readings else None
        ctx.views.memo[question] = (inversion_of(d.reading, d.basis)
                                    if d is not None and d.reading is not None else None)
    got = ctx.views.memo[question]
    return got if isinstance(got, Inversion) else None


# ------------------------------------------------------------------------------ aborts


def _posted_from(r: int, div: Divergence, views: RankViews) -> tuple[Frame, ...]:
    """The user frames that posted rank r's collective at the divergence (the recorder's),
    else where the rank is (a rank that aborted inside it left its stack)."""
    c = views[r].tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
    return (user_frames(c.frames) if c is not None and c.frames else ()) \
        or tuple(views[r].position)


def mark_skipped(div: Divergence, culprits: list[int], ctx: Context) -> bool:
    """Culprits whose collective at the divergence is one the program posts *after* the
    others' (a step on, a run of experts cut short) skipped the others': they never posted
    it, and its line — the others' — is the one to show (their entry becomes None)."""
    if div.seq is None or div.kind != MismatchKind.MISSING:
        return False
    others = [r for r, c in div.per_rank.items() if c is not None and r not in culprits]
    theirs = next((c for r in others if (c := _entry(r, div, ctx.views)) is not None), None)
    if theirs is None:
        return False
    done = False
    for r in culprits:
        mine = _entry(r, div, ctx.views)
        if mine is not None and div.per_rank.get(r) is not None \
                and ctx.program.skipped_to(mine, theirs):
            div.per_rank[r] = None
            done = True
    return done


def _entry(r: int, div: Divergence, views: RankViews) -> Collective | None:
    """Rank r's collective at the divergence: its own record, else what the abort told of it
    (its op and sizes, posted from where its stack is)."""
    if div.seq is not None and (c := views[r].tl.by_pg.get(div.pg, {}).get(div.seq)):
        return c
    rc = div.per_rank.get(r)
    if rc is None or div.seq is None:
        return None
    return Collective(pg=div.pg, seq=div.seq, op=rc.op, pg_desc=div.pg_desc,
                      input_sizes=rc.input_sizes, dtypes=rc.dtypes,
                      frames=list(views[r].stack.frames), source="inferred")


def _nbytes(c: RankCollective) -> int | None:
    return nbytes(c.input_sizes, c.dtypes)


def blame_abort(div: Divergence, ctx: Context, abort: SizeAbort | None,
                aborted: list[int]) -> Blame:
    """gloo aborted a rank (a peer sent more bytes than it expected) before it could dump
    its recorder. The camps are the lines each posted from (a rank that went past posts from
    another line); on one line, the sizes — where the abort's byte ratio matches the two
    sizes the others posted, the aborted rank is the one that expected less. The camps'
    readings go to the one ladder."""
    views = ctx.views
    entries = {r: c for r, c in div.per_rank.items() if c is not None}
    # a rank whose line is not known (a recorder without frames, a stack without the main
    # thread) is no camp of its own: it would make the ranks whose line is known look
    # like the majority against it
    sites = {r: (c.op, (c.callsite.file, c.callsite.line))
             for r, c in entries.items() if c.callsite is not None}
    colls = {r: _entry(r, div, views) for r in entries}
    if len(camps := _sides(dict(sites))) > 1:
        readings = [replace(x, at_mine=_posted_from(x.culprits[0], div, views),
                            at_theirs=_posted_from(x.others[0], div, views))
                    for x in camp_readings(div.pg, div.seq, camps, colls, views)]
        return _decided(readings, ctx, sorted(entries))
    sizes = {r: b for r, c in entries.items() if (b := _nbytes(c)) is not None}
    distinct = sorted(set(sizes.values()))
    if abort is not None and abort.received and abort.expected and len(distinct) == 2:
        ratio = abort.received / abort.expected
        if abs(distinct[1] / distinct[0] - ratio) < 0.01 * ratio:
            small = next(colls[r] for r in sorted(sizes) if sizes[r] == distinct[0])
            for r in aborted:  # it expected the smaller message: it holds the smaller tensor
                if r not in sizes:
                    sizes[r], colls[r] = distinct[0], small
    camps = _sides(dict(sizes))
    unknown = sorted(r for r in entries if r not in sizes)
    if len(camps) > 1:  # where the known sizes differ, one of unknown size is no camp
        return _decided(camp_readings(div.pg, div.seq, camps, colls, views), ctx,
                        sorted(entries))
    if camps and unknown:
        return _decided(_inferred_readings(div, ctx, camps[0], unknown, colls), ctx,
                        sorted(entries), confirmed=False)
    return Blame(sorted(entries), CulpritBasis.AMBIGUOUS)


def _inferred_readings(div: Divergence, ctx: Context, known: list[int], unknown: list[int],
                       colls: dict[int, Collective | None]) -> list[Reading]:
    """One camp's sizes known (the survivors'), the aborted rank's not (gloo's byte counts of
    a ring's chunks say nothing of its tensor): the known collective either is the shape
    that collective always had — then the other side changed — or is not — then it did
    (the history rung, given)."""
    c = ctx.views[known[0]].tl.by_pg.get(div.pg, {}).get(div.seq) \
        if div.seq is not None else None
    keeps = ctx.program.keeps_shape(c) if c is not None and c.input_sizes else None
    out = []
    for x in camp_readings(div.pg, div.seq, [known, unknown], colls, ctx.views):
        blames_unknown = x.culprits == tuple(unknown)
        # nothing else is seen of the unknown side: no count of it, no order
        out.append(replace(x, given={CulpritBasis.HISTORY: None if keeps is None
                                     else keeps == blames_unknown,
                                     CulpritBasis.MAJORITY: None,
                                     CulpritBasis.PROGRAM_ORDER: None}))
    return out


def _decided(readings: list[Reading], ctx: Context, every: list[int],
             confirmed: bool = True) -> Blame:
    d = decide(readings, ctx)
    if d.basis == CulpritBasis.AMBIGUOUS:
        return Blame(every, CulpritBasis.AMBIGUOUS)
    return Blame(d.culprits, d.basis, confirmed=confirmed, reading=d.reading)


__all__ = ["Blame", "at", "blame", "blame_abort", "blame_cycle", "condition_on",
           "cycle_inversion", "mark_skipped"]
