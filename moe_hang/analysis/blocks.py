"""Where two ranks' sequences of collectives part, aligned the way ``diff`` aligns lines — by
what they posted, not by their sequence numbers (docs/DESIGN.md §8.4). Pure, detection only:
who deviated is :mod:`.ladder`'s to say.

Up to a group's divergence every member posted the same collectives under the same sequence
numbers. From there on, a rank that posted a block the others never posted (a rank-only
evaluation, a checkpoint, a logging all-reduce) or skipped one they all posted (an expert that
got no token) is one block out of step with them: its later collectives pair with the others'
*earlier* ones — silently while the shapes agree (FSDP's all-gathers of one layer look like the
next's) — and the job breaks collectives later. Aligning the two sequences by content finds the
block where it started, whatever broke afterwards. A diff is not symmetric (one rank's extra
all-reduce, or the other's skipped all-gather, can fit the same two sequences): both ways are
read, and each reading goes to the ladder.

A collective's *identity* here is what tells it apart across ranks: its op, its sizes where
every member must agree, its dtypes, and the user code that posted it (the probe's tag, else
the user frames of its stack).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.placing import placed_in_run
from moe_hang.analysis.program import signature
from moe_hang.analysis.rankstate import posted_after, site_key
from moe_hang.analysis.source import (
    alike_in_a_pass,
    every_pass,
    excludes_ranks,
    gates,
    loop_counters,
    loop_step,
    path_condition,
)
from moe_hang.analysis.timeline import RankView, RankViews, group_kind
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.source import SourceFacts, Step
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
    if not frames and c.completed is False and v.stack.frames and v.stack.op == c.op \
            and not posted_after(v.tl, c, v.stack.thread_id):
        frames = v.stack.frames
    user = tuple((f.file, f.line, f.function) for f in reversed(frames)
                 if not is_library_frame(f))
    return ("stack", user) if user else None


def identity(c: Collective, v: RankView) -> Identity:
    """What must be equal for two ranks' entries to be the same collective."""
    return (*signature(c), user_code(c, v))


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
    data_branch: bool = False  # ``condition`` is the branch its line sits in, on no rank test
    counts: dict[int, int] = field(default_factory=dict)  # collectives like the block's, each
    # the frames of what the same op is posted from otherwise (the other side's, or earlier
    # steps'): the block's own line is its innermost user frame that is not among them
    reference: list[Frame] = field(default_factory=list)
    # what each side posted right where they part: the lacking side's first collective (the
    # one after the block), the having side's after the block
    lacking_next: Collective | None = None
    # where the source places the block when its collectives carry no call site, user frames
    # outermost first: the loop's call of the helper that posts it, the posting line there
    # (:func:`helper_block`)
    posted_from: tuple[Frame, ...] = ()
    by_fsdp: bool = False  # and FSDP posts it there (the source shows it, not a frame)
    placed: bool = False  # moved in a run of alike ones to the one from a new line

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
        return best[0] if best else self.posted_from[-1] if self.posted_from else None


@dataclass(frozen=True)
class Parting:
    """What two camps' tails from a divergent seq are: blocks one has and the other lacks
    (each way the diff reads), or two code paths that post the same collectives
    (``benign``), or neither."""

    blocks: tuple[Block, ...] = ()
    benign: bool = False


def taken_branch(src: SourceFacts, frames: Sequence[Frame]) -> str | None:
    """The nearest ``if`` a block's posting line sits in (its body, or its ``else``), on its
    user frames innermost first: the data decision its ranks took and the others did not
    (``if (counts == 0).any():``), where no rank condition names one. A guard before the line
    that leaves early is not one (the line runs where it was not taken)."""
    for f in frames:
        if is_library_frame(f):
            continue
        counters = loop_counters(src.line(f.file, f.line))
        loop = loop_step(src, f.file, f.line, f.line)
        for g in gates(src, f.file, f.line):
            if g.how not in ("if", "else") or alike_in_a_pass(g.test, counters):
                continue  # a test every rank decides alike in a pass (``step % 4 == 0``)
            if loop is not None and g.line < loop.line <= g.end:
                return None  # a loop inside the branch: how many passes, not the branch
            return f"if {g.test}" if g.how == "if" else f"if not ({g.test})"
    return None


def tail(pg: str, seq: int, r: int, views: RankViews) -> list[Collective]:
    return [c for s, c in sorted(views[r].tl.by_pg.get(pg, {}).items()) if s >= seq]


def part(pg: str, seq: int, camps: Sequence[list[int]], views: RankViews) -> Parting:
    """The first difference, by content, between the camps' collectives from ``seq`` on
    (each camp: ranks whose entry at ``seq`` is the same collective), against the largest
    camp (ties: the first; its ranks decide nothing)."""
    if len(camps) < 2:
        return Parting()
    ref = max(camps, key=len)
    found: list[tuple[Block, ...]] = []
    for camp in camps:
        if camp is ref:
            continue
        one, two = _pair(pg, seq, ref, camp, views), _pair(pg, seq, camp, ref, views)
        if one.benign and two.benign:
            return Parting(benign=True)
        got = tuple(b for x in (one, two) for b in x.blocks)
        if not got:
            return Parting()
        found.append(got)
    if len(found) == 1:
        blocks = found[0]
    else:  # every other camp differs from the largest by a block: one reading if they agree
        firsts = [f[0] for f in found]
        head = firsts[0]
        if any(b.having != head.having and b.lacking != head.lacking for b in firsts[1:]):
            return Parting()
        blocks = (Block(head.start, sorted({r for b in firsts for r in b.having}),
                        sorted({r for b in firsts for r in b.lacking}), head.items,
                        min(b.after for b in firsts), lacking_next=head.lacking_next),)
    out = []
    seen: set[tuple[object, ...]] = set()
    for b in blocks:
        key = (tuple(b.having), tuple(b.lacking), b.start, len(b.items))
        if key in seen:
            continue
        seen.add(key)
        if len(b.items) == 1 and (q := placed_in_run(pg, b.start, b.having, b.lacking,
                                                     views)) is not None:
            tl = views[b.lacking[0]].tl.by_pg.get(pg, {})
            b = replace(b, start=q, items=[views[b.having[0]].tl.by_pg[pg][q]], placed=True,
                        after=b.after + b.start - q, lacking_next=tl.get(q))
        if b.items:  # and what the same op was posted from before, on this rank
            b.reference = b.reference + _regular(pg, b.items[0], b.having[0], views)
        b.counts = _counts(pg, b, views)
        out.append(b)
    return Parting(tuple(out))


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
            signature(x) == signature(y) for x, y in zip(ta[i1:i2], tb[j1:j2], strict=True)):
        return Parting(benign=True)  # two code paths posting the same collectives

    def block(have: list[int], lack: list[int], items: list[Collective], t_have: list[Collective],
              t_lack: list[Collective], at: int) -> Parting:
        return Parting((Block(seq, sorted(have), sorted(lack), items, after,
                              reference=_frames(t_lack),
                              lacking_next=t_lack[at] if at < len(t_lack) else None),))

    if tag == "delete" and after:  # a has ta[i1:i2] that b lacks
        return block(a, b, ta[i1:i2], ta, tb, j1)
    if tag == "insert" and after:
        return block(b, a, tb[j1:j2], tb, ta, i1)
    if tag == "replace" and after and min(i2 - i1, j2 - j1) == 0:
        return Parting()
    # one camp's block is longer, and the rest lines up: the longer one has an extra run of
    # the same collective (a skipped expert's all-gather looks like the next expert's)
    if tag == "replace" and after and ia[i1:i2][-(j2 - j1):] == ib[j1:j2]:
        return block(a, b, ta[i1:i2 - (j2 - j1)], ta, tb, j1)
    if tag == "replace" and after and ib[j1:j2][-(i2 - i1):] == ia[i1:i2]:
        return block(b, a, tb[j1:j2 - (i2 - i1)], tb, ta, i1)
    return Parting()


def conditional_block(pg: str, seq: int, ranks: list[int], views: RankViews) -> Block | None:
    """Where the others' collectives up to ``seq`` cannot be compared (their recorder died
    with them: only their counts and stacks are left), the source can still say what one
    rank posted that the others did not: a run of collectives right before (or at) ``seq``
    posted from code that runs under a rank condition, where no other rank posted from that
    code (and none from a branch of the same condition)."""
    def cond_of(c: Collective) -> str | None:
        return path_condition(views.source, c.frames)

    for r in ranks:
        entries = views[r].tl.by_pg.get(pg, {})
        s = seq if seq in entries and cond_of(entries[seq]) else seq - 1
        run: list[Collective] = []
        cond: str | None = None
        while s in entries and (c := cond_of(entries[s])) is not None:
            run.insert(0, entries[s])
            cond = cond or c
            s -= 1
        if not run or (cond is not None and excludes_ranks(cond)):
            continue  # an `else` (or `!=`) branch: the ranks it names are the odd ones
        others = [q for q in ranks if q != r]
        seen = [views[q].tl.by_pg.get(pg, {}).get(c.seq) for q in others for c in run]
        if any(o is not None and (cond_of(o) is not None
                                  or user_code(o, views[q]) == user_code(c, views[r]))
               for q in others for c in run
               if (o := views[q].tl.by_pg.get(pg, {}).get(c.seq)) is not None):
            continue  # another rank posted from that code too, or from a branch of it
        if not any(o is None for o in seen):
            continue  # the others' collectives are known there: the diff speaks for them
        return Block(run[0].seq, [r], sorted(others), run, 0, condition=cond,
                     reference=_regular(pg, run[0], r, views))
    return None


def helper_block(pg: str, seq: int, camps: Sequence[list[int]],
                 views: RankViews) -> Block | None:
    """Where the recorder keeps no call sites and a camp of one rank is in its loop's line
    (``L``) at ``seq`` while the others are later in the same pass: the last collective every
    pass posts by name with an op no other call of the loop has (the anchor) was posted by
    all as one number; the others posted ``L``'s first right after it, the rank as many more
    as lie between — the one helper a branch of the loop calls between the anchor and ``L``
    that posts that op (a rank-only evaluation or checkpoint: FSDP's all-gathers, alike
    ``L``'s, paired silently with theirs), where the rank's collective now is the others'
    first after the anchor. A block of the rank's, placed by the source."""
    src = views.source
    if len(camps) != 2:
        return None
    for mine, theirs in (camps, camps[::-1]):
        if len(mine) != 1:
            continue
        a = mine[0]
        cur = views[a].tl.by_pg.get(pg, {}).get(seq)
        spot = _loop_spot(views[a].position, src)
        if cur is None or cur.frames or spot is None:
            continue
        at, body = spot
        later = [_loop_spot(views[b].position, src) for b in theirs]
        if any(x is None or x[1] != body or x[0].line <= at.line for x in later):
            continue
        order = [n for n in body.calls if n < at.line][::-1] \
            + [n for n in body.calls if n > at.line][::-1]
        # the anchor: the last call by name before L (one between would count too)
        anchor = order[0] if order else None
        lf_anchor = src.line(at.file, anchor) if anchor is not None else None
        if anchor is None or lf_anchor is None or lf_anchor.call is None \
                or not every_pass(src, replace(at, line=anchor), at) \
                or sum(1 for n in body.calls if (o := src.line(at.file, n)) is not None
                       and o.call == lf_anchor.call) != 1:
            continue
        lo, hi = anchor, at.line
        helpers = [h for h in body.helpers if (lo < h[0] < hi if lo < hi else not hi <= h[0] <= lo)
                   and h[3] == normalise_op(cur.op)
                   and not every_pass(src, Frame(at.file, h[0], at.function), at)]
        if len(helpers) != 1:
            continue
        call, line, name, _, how = helpers[0]
        op = normalise_op(lf_anchor.call)
        last = {r: max((c.seq for c in views[r].tl.by_pg.get(pg, {}).values()
                        if c.seq < seq and normalise_op(c.op) == op),
                       default=None) for r in (a, *theirs)}
        start = last[a]
        if start is None or len(set(last.values())) != 1 or seq - start < 2:
            continue
        items = [views[a].tl.by_pg[pg].get(s) for s in range(start + 1, seq)]
        first = [views[b].tl.by_pg.get(pg, {}).get(start + 1) for b in theirs]
        if any(c is None or c.frames or normalise_op(c.op) != normalise_op(cur.op)
               for c in items) or any(c is None or signature(c) != signature(cur)
                                      for c in first):
            continue
        return Block(start + 1, [a], sorted(theirs), [c for c in items if c is not None], 1,
                     condition=path_condition(src, [Frame(at.file, call, at.function)]),
                     lacking_next=first[0], posted_from=(replace(at, line=call),
                                                         Frame(at.file, line, name)),
                     by_fsdp=how == "fsdp")
    return None


def _loop_spot(position: Sequence[Frame], src: SourceFacts) -> tuple[Frame, Step] | None:
    """The outermost of a rank's frames in a loop's body, with the loop."""
    for f in position:
        if (body := loop_step(src, f.file, f.line, f.line)) is not None:
            return f, body
    return None


def _frames(t: list[Collective]) -> list[Frame]:
    """The frames the other side posted its first collectives from."""
    return [f for c in t[:4] for f in c.frames]


def _regular(pg: str, first: Collective, r: int, views: RankViews) -> list[Frame]:
    """The frames the rank posted the same op from before the block: its regular path."""
    before = [c for s, c in sorted(views[r].tl.by_pg.get(pg, {}).items())
              if s < first.seq and c.op == first.op and c.frames]
    return [f for c in before[-64:] for f in c.frames if not is_library_frame(f)]


def _counts(pg: str, b: Block, views: RankViews) -> dict[int, int]:
    """How many collectives like the block's first each rank posted from its start to the
    end of what lines up after it (a run of one expert's all-gathers, counted)."""
    if not b.items:
        return {}

    def like(c: Collective) -> tuple[object, ...]:
        return (c.op, group_kind(c), site_key(c))

    first = like(b.items[0])
    out = {}
    for r in b.having + b.lacking:
        n = (len(b.items) if r in b.having else 0) + b.after
        out[r] = sum(1 for c in tail(pg, b.start, r, views)[:n] if like(c) == first)
    return out
