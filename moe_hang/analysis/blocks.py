"""Where two ranks' sequences of collectives part, aligned the way ``diff`` aligns lines — by
what they posted, not by their sequence numbers (docs/DESIGN.md §8). Pure, detection only.

Up to a group's divergence every member posted the same collectives under the same sequence
numbers. From there on, a rank that posted a block the others never posted (a rank-only
evaluation, a checkpoint, a logging all-reduce) or skipped one they all posted (an expert that
got no token) is one block out of step with them: its later collectives pair with the others'
*earlier* ones — silently while the shapes agree (FSDP's all-gathers of one layer look like the
next's) — and the job breaks collectives later. Aligning the two sequences by content finds the
block where it started, whatever broke afterwards.

A collective's *identity* here is what tells it apart across ranks: its op, its sizes where
every member must agree, its dtypes, and the user code that posted it (the probe's tag, else
the user frames of its stack). Whether a block is an *extra* on the ranks that have it or a
*skip* on those that lack it: a strict majority decides; else earlier steps (a block every
rank posted before is part of the program: its absence is the skip; one never seen before,
posted under a rank condition, is the extra); else nothing decides, and both are named.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.source import excludes_ranks, path_condition
from moe_hang.analysis.timeline import RankView, RankViews, group_kind, site_key
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.ops import SAME_SIZE_OPS
from moe_hang.evidence.stacks import Frame, is_library_frame

Identity = tuple[object, ...]

EXTRA = "extra"  # the ranks that have the block posted collectives the others never did
SKIP = "skip"  # the ranks that lack it skipped collectives the others all posted


def user_code(c: Collective, v: RankView) -> tuple[object, ...] | None:
    """The user code that posted ``c``: the probe's tag, else the user frames of its stack
    (outermost first) — the recorder's, or, for the collective a rank is blocked in, its stack
    now. None when nothing says."""
    if c.tag:
        return ("tag", c.tag)
    frames = c.frames if c.source != "probe" else []
    if not frames and c.completed is False and v.stack.frames and v.stack.op == c.op:
        frames = v.stack.frames
    user = tuple((f.file, f.line, f.function) for f in reversed(frames)
                 if not is_library_frame(f))
    return ("stack", user) if user else None


def identity(c: Collective, v: RankView) -> Identity:
    """What must be equal for two ranks' entries to be the same collective."""
    sizes = tuple(tuple(s) for s in c.input_sizes) if c.op in SAME_SIZE_OPS else ()
    return (c.op, sizes, tuple(c.dtypes), user_code(c, v))


@dataclass
class Block:
    """From seq ``start`` of a group on, ``having`` posted ``items`` that ``lacking`` never
    posted; then ``after`` collectives of the two line up again. ``decided``: EXTRA (on
    ``having``), SKIP (on ``lacking``), None (the evidence does not decide)."""

    start: int
    having: list[int]
    lacking: list[int]
    items: list[Collective]  # as the first of ``having`` posted them
    after: int
    decided: str | None = None
    basis: CulpritBasis = CulpritBasis.AMBIGUOUS
    condition: str | None = None  # the rank condition on the extra's path, read from source
    counts: dict[int, int] = field(default_factory=dict)  # collectives like the block's, each
    # the frames of what the same op is posted from otherwise (the other side's, or earlier
    # steps'): the block's own line is its innermost user frame that is not among them
    reference: list[Frame] = field(default_factory=list)

    @property
    def culprits(self) -> list[int]:
        if self.decided == EXTRA:
            return sorted(self.having)
        if self.decided == SKIP:
            return sorted(self.lacking)
        return sorted(self.having + self.lacking)

    @property
    def site(self) -> Frame | None:
        """The user line that posted the block: its first collective's innermost user frame
        that the same op's regular path does not share (an evaluation's ``model(x)``, not the
        ``block(x)`` inside the model every forward runs through)."""
        user = [f for f in (self.items[0].frames if self.items else [])
                if not is_library_frame(f)]
        shared = {(f.file, f.line, f.function) for f in self.reference}
        own = [f for f in user if (f.file, f.line, f.function) not in shared]
        best = own or user
        return best[0] if best else None


@dataclass(frozen=True)
class Parting:
    """What two camps' tails from a divergent seq are: a block one has and the other lacks,
    or two code paths that post the same collectives (``benign``), or neither."""

    block: Block | None = None
    benign: bool = False


def tail(pg: str, seq: int, r: int, views: RankViews) -> list[Collective]:
    return [c for s, c in sorted(views[r].tl.by_pg.get(pg, {}).items()) if s >= seq]


def part(pg: str, seq: int, camps: Sequence[list[int]], views: RankViews) -> Parting:
    """The first difference, by content, between the camps' collectives from ``seq`` on
    (each camp: ranks whose entry at ``seq`` is the same collective)."""
    if len(camps) < 2:
        return Parting()
    ref = max(camps, key=len)  # the largest camp; ties: the first (its ranks decide nothing)
    found: list[Block] = []
    for camp in camps:
        if camp is ref:
            continue
        got = _pair_both_ways(pg, seq, ref, camp, views)
        if got.block is None:
            return got
        found.append(got.block)
    # every other camp differs from the largest by a block: one verdict if they agree
    first = found[0]
    if len(found) > 1 and any(b.having != first.having and b.lacking != first.lacking
                              for b in found[1:]):
        return Parting()
    if len(found) > 1:
        first = Block(first.start, sorted({r for b in found for r in b.having}),
                      sorted({r for b in found for r in b.lacking}), first.items,
                      min(b.after for b in found))
    if first.decided is None:
        _decide(first, pg, views)
    if first.items:  # and what the same op was posted from before, on this rank
        first.reference = first.reference + _regular(pg, first.items[0], first.having[0], views)
    first.counts = _counts(pg, first, views)
    return Parting(first)


def _pair_both_ways(pg: str, seq: int, a: list[int], b: list[int],
                    views: RankViews) -> Parting:
    """A diff is not symmetric where two readings fit the same sequences (one rank's extra
    all-reduce, or the other's skipped all-gather): both are tried, and the one that keeps
    the order earlier steps followed wins."""
    one, two = _pair(pg, seq, a, b, views), _pair(pg, seq, b, a, views)
    cands = [x.block for x in (one, two) if x.block is not None]
    if not cands:
        return one
    follows = _followers(pg, seq, views)
    if follows:
        prev = _loose(_at(pg, seq - 1, (a + b)[0], views))
        for blk in cands:  # the skipped block is what always came next; the others' is not
            h, lk = _first_at(pg, blk.having, seq, views), _first_at(pg, blk.lacking, seq, views)
            if h in follows.get(prev, ()) and lk not in follows.get(prev, ()):
                blk.decided, blk.basis = SKIP, CulpritBasis.HISTORY
                return Parting(blk)
        for blk in cands:  # what the others posted is what always came next: an extra here
            h, lk = _first_at(pg, blk.having, seq, views), _first_at(pg, blk.lacking, seq, views)
            if lk in follows.get(prev, ()) and h not in follows.get(prev, ()):
                blk.decided, blk.basis = EXTRA, CulpritBasis.HISTORY
                return Parting(blk)
    return Parting(cands[0])


def _at(pg: str, seq: int, r: int, views: RankViews) -> Collective | None:
    return views[r].tl.by_pg.get(pg, {}).get(seq)


def _first_at(pg: str, ranks: list[int], seq: int,
              views: RankViews) -> tuple[object, ...] | None:
    c = _at(pg, seq, ranks[0], views)
    return _loose(c) if c is not None else None


def _followers(pg: str, before: int,
               views: RankViews) -> dict[tuple[object, ...], set[tuple[object, ...]]]:
    """In the agreed steps before ``before``: which collective came right after which."""
    out: dict[tuple[object, ...], set[tuple[object, ...]]] = {}
    for v in views.values():
        seqs = sorted(s for s in v.tl.by_pg.get(pg, {}) if s < before)
        by = v.tl.by_pg[pg] if seqs else {}
        for x, y in itertools.pairwise(seqs):
            if y == x + 1:
                out.setdefault(_loose(by[x]), set()).add(_loose(by[y]))
    return out


def _pair(pg: str, seq: int, a: list[int], b: list[int], views: RankViews) -> Parting:
    ta, tb = tail(pg, seq, a[0], views), tail(pg, seq, b[0], views)
    ia = [identity(c, views[a[0]]) for c in ta]
    ib = [identity(c, views[b[0]]) for c in tb]
    if any(i[-1] is None for i in ia + ib):
        # where one side's code is not known, code tells nothing: compare what was posted
        ia, ib = [i[:-1] for i in ia], [i[:-1] for i in ib]
    ops = SequenceMatcher(None, ia, ib, autojunk=False).get_opcodes()
    if not ops:
        return Parting()
    tag, i1, i2, j1, j2 = ops[0]
    nxt = ops[1] if len(ops) > 1 else None
    after = nxt[2] - nxt[1] if nxt is not None and nxt[0] == "equal" else 0
    if tag == "replace" and i2 - i1 == j2 - j1 and after and all(
            _same_but_site(x, y) for x, y in zip(ta[i1:i2], tb[j1:j2], strict=True)):
        return Parting(benign=True)  # two code paths posting the same collectives
    if tag == "delete" and after:  # a has ta[i1:i2] that b lacks
        return Parting(Block(seq, sorted(a), sorted(b), ta[i1:i2], after,
                             reference=_frames(tb)))
    if tag == "insert" and after:
        return Parting(Block(seq, sorted(b), sorted(a), tb[j1:j2], after,
                             reference=_frames(ta)))
    if tag == "replace" and after and min(i2 - i1, j2 - j1) == 0:
        return Parting()
    # one camp's block is longer, and the rest lines up: the longer one has an extra run of
    # the same collective (a skipped expert's all-gather looks like the next expert's)
    if tag == "replace" and after and ia[i1:i2][-(j2 - j1):] == ib[j1:j2]:
        return Parting(Block(seq, sorted(a), sorted(b), ta[i1:i2 - (j2 - j1)], after,
                             reference=_frames(tb)))
    if tag == "replace" and after and ib[j1:j2][-(i2 - i1):] == ia[i1:i2]:
        return Parting(Block(seq, sorted(b), sorted(a), tb[j1:j2 - (i2 - i1)], after,
                             reference=_frames(ta)))
    return Parting()


def _frames(t: list[Collective]) -> list[Frame]:
    """The frames the other side posted its first collectives from."""
    return [f for c in t[:4] for f in c.frames]


def _regular(pg: str, first: Collective, r: int, views: RankViews) -> list[Frame]:
    """The frames the rank posted the same op from before the block: its regular path."""
    before = [c for s, c in sorted(views[r].tl.by_pg.get(pg, {}).items())
              if s < first.seq and c.op == first.op and c.frames]
    return [f for c in before[-64:] for f in c.frames if not is_library_frame(f)]


def conditional_block(pg: str, seq: int, ranks: list[int], views: RankViews) -> Block | None:
    """Where the others' collectives up to ``seq`` cannot be compared (their recorder died
    with them: only their counts and stacks are left), the source can still say what one
    rank posted that the others did not: a run of collectives right before (or at) ``seq``
    posted from code that runs under a rank condition, where no other rank posted from that
    code (and none from a branch of the same condition)."""
    for r in ranks:
        entries = views[r].tl.by_pg.get(pg, {})
        s = seq if seq in entries and condition_of(entries[seq], views) else seq - 1
        run: list[Collective] = []
        cond: str | None = None
        while s in entries and (c := condition_of(entries[s], views)) is not None:
            run.insert(0, entries[s])
            cond = cond or c
            s -= 1
        if not run or (cond is not None and excludes_ranks(cond)):
            continue  # an `else` (or `!=`) branch: the ranks it names are the odd ones
        others = [q for q in ranks if q != r]
        seen = [views[q].tl.by_pg.get(pg, {}).get(c.seq) for q in others for c in run]
        if any(o is not None and (condition_of(o, views) is not None
                                  or user_code(o, views[q]) == user_code(c, views[r]))
               for q in others for c in run
               if (o := views[q].tl.by_pg.get(pg, {}).get(c.seq)) is not None):
            continue  # another rank posted from that code too, or from a branch of it
        if not any(o is None for o in seen):
            continue  # the others' collectives are known there: the diff speaks for them
        return Block(run[0].seq, [r], sorted(others), run, 0, EXTRA, CulpritBasis.SOURCE,
                     cond, reference=_regular(pg, run[0], r, views))
    return None


def _same_but_site(x: Collective, y: Collective) -> bool:
    return (x.op, x.input_sizes, x.dtypes) == (y.op, y.input_sizes, y.dtypes)


def _decide(b: Block, pg: str, views: RankViews) -> None:
    """Extra on ``having``, or a skip on ``lacking``: a strict majority; else earlier steps;
    else the source (a rank condition on the extra's path); else undecided."""
    if len(b.having) != len(b.lacking):
        minority = b.having if len(b.having) < len(b.lacking) else b.lacking
        b.decided = EXTRA if minority is b.having else SKIP
        b.basis = CulpritBasis.MAJORITY
    else:
        seen = _history(pg, b.start, views)
        ids = [_loose(c) for c in b.items]
        if seen and all(i in seen for i in ids):
            b.decided, b.basis = SKIP, CulpritBasis.HISTORY  # a regular part of every step
        elif seen and not any(i in seen for i in ids):
            b.decided, b.basis = EXTRA, CulpritBasis.HISTORY  # never posted before
    if b.decided is None and _tagged_in_order(b, pg, views):
        b.decided, b.basis = SKIP, CulpritBasis.PROGRAM_ORDER
    cond = condition_of(b.items[0], views) if b.items else None
    if cond is not None and excludes_ranks(cond):
        # posted under `if not (FAULTY ...)` / an `else`: every rank but the ones the
        # condition names runs it — those lacking it took the singled-out branch
        if b.decided is None:
            b.decided, b.basis = SKIP, CulpritBasis.SOURCE
    elif cond is not None and b.decided in (None, EXTRA):
        b.condition = cond
        if b.decided is None:
            b.decided, b.basis = EXTRA, CulpritBasis.SOURCE


def _tagged_in_order(b: Block, pg: str, views: RankViews) -> bool:
    """The probe's tags (``layer1.expert2``) name each logical collective of a step, in the
    order the program posts them: the block is one of them, and the lacking ranks posted the
    one that follows it in its place — they went past it."""
    if not b.items or not all(c.tag for c in b.items):
        return False
    nxt = tail(pg, b.start, b.having[0], views)[len(b.items):len(b.items) + 1]
    here = tail(pg, b.start, b.lacking[0], views)[:1]
    return bool(nxt and here and nxt[0].tag and nxt[0].tag == here[0].tag)


def _loose(c: Collective | None) -> tuple[object, ...]:
    """What a collective is, step after step: its op, its group's kind and the line that posted
    it (sizes vary from step to step in a ragged job)."""
    return (c.op, group_kind(c), site_key(c)) if c is not None else ()


def _history(pg: str, before: int, views: RankViews) -> set[tuple[object, ...]]:
    """What the ranks posted on this group before ``before``: the steps all members agreed
    on."""
    out: set[tuple[object, ...]] = set()
    for v in views.values():  # before ``before`` every member posted the same: agreed steps
        out.update(_loose(c) for s, c in v.tl.by_pg.get(pg, {}).items()
                   if s < before and _loose(c)[2] is not None)
    return out


def condition_of(c: Collective, views: RankViews) -> str | None:
    """A rank condition (``if rank == 0:``) on the user path that posted ``c``, outermost
    first: the extra runs only where it holds."""
    return path_condition(views.source, c.frames)


def _counts(pg: str, b: Block, views: RankViews) -> dict[int, int]:
    """How many collectives like the block's first each rank posted from its start to the
    end of what lines up after it (a run of one expert's all-gathers, counted)."""
    if not b.items:
        return {}
    like = _loose(b.items[0])
    out = {}
    for r in b.having + b.lacking:
        n = (len(b.items) if r in b.having else 0) + b.after
        out[r] = sum(1 for c in tail(pg, b.start, r, views)[:n] if _loose(c) == like)
    return out
