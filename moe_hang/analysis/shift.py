"""A count shift on a group (docs/DESIGN.md §8): at a line of a loop's body that posts a
collective on group G whatever the rank (no ``if``, no early leave, no rank condition before
it in the body), the ranks waiting in it as G#s there, and the ranks past it in the same pass,
or a pass on (waiting at an earlier line in what every pass posts and the ahead ranks have
not) — having posted it themselves, as an earlier number — skipped nothing there; so did
a rank that left the loop for good and waits, as the number they wait in, in the statement
right after it (:func:`_left_after`). One side posted more collectives on G before this
pass's line than the other: an extra (gloo paired it silently with the other side's next one
of equal size) or a skip. Which side: the ladder on
the two readings (counts only: the majority rung), the smaller one; as many on each side, or
the passed ranks at different counts, decides nothing. Read on a wait-for cycle's edges
(:func:`count_shift`) and beside the camps of a desync at one seq
(:func:`divergence_shifts`). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from moe_hang.analysis.diagnosis import (
    CulpritBasis,
    Verdict,
    pg_label,
)
from moe_hang.analysis.explain import site_str
from moe_hang.analysis.gates import alike, went_through
from moe_hang.analysis.ladder import COUNTS_ONLY, Context, Decision, Edit, Reading, decide
from moe_hang.analysis.passes import loop_between
from moe_hang.analysis.placing import new_posts, user_line
from moe_hang.analysis.readings import at
from moe_hang.analysis.situation import Advice
from moe_hang.analysis.source import (
    branch_call,
    every_pass,
    excludes_ranks,
    loop_step,
    rank_condition,
    taken_only_by,
)
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.analysis.waitfor import Edge
from moe_hang.evidence.flight_recorder import DEFAULT_PG, Collective
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import agree, who


@dataclass(frozen=True)
class Shift:
    op: str
    pg: str
    pg_desc: str
    seq: int  # what the ahead side waits in
    passed_seq: int  # what the passed side posted that line's collective as
    ahead: tuple[int, ...]  # waiting in it
    passed: tuple[int, ...]  # past its line in the same pass
    site: Frame  # the line
    readings: tuple[Reading, Reading]  # the ahead side's extra, the passed side's skip
    decision: Decision | None = None  # the ladder's, where it chose one of the two
    # the passed side posts its own collective as ``seq`` (past the loop): a camp of a
    # desync there, whose difference the shift explains
    same_seq: bool = False

    @property
    def extra(self) -> bool:
        return self.chosen is not None and self.chosen.edit == Edit.EXTRA

    @property
    def chosen(self) -> Reading | None:
        r = self.decision.reading if self.decision is not None else None
        return r if any(r is x for x in self.readings) else None

    @property
    def basis(self) -> CulpritBasis:
        return self.decision.basis if self.decision is not None else CulpritBasis.AMBIGUOUS

    @property
    def culprits(self) -> list[int]:
        return sorted(self.chosen.culprits) if self.chosen is not None else []

    @property
    def others(self) -> list[int]:
        return sorted(set(self.ahead + self.passed) - set(self.culprits))


def count_shift(cycle: list[Edge], ctx: Context) -> Shift | None:
    """The shift on the first edge whose passed ranks are later in the same pass; else on the
    first whose are a pass on (a pass read from another group's counts, which a shift on
    that group would read alike: the same pass is the one edit, and it goes first). The
    two readings — the ahead side's extra, the passed side's skip — go to the ladder."""
    for laps in (False, True):
        for e in cycle:
            if e.coll is not None and (sh := shift_at(e.coll, e.waiter, ctx, laps)) is not None:
                d = decide(sh.readings, ctx)
                if d.reading is not None:  # as many on each side: the counts decide nothing
                    return replace(sh, decision=d)
    return None


def divergence_shifts(entries: Mapping[int, Collective | None], ctx: Context) -> list[Shift]:
    """Where ranks posted different collectives at one seq: a count shift at each camp's
    line (the ranks past it in the same pass numbered it lower), for the ladder to weigh
    beside the camps' own readings — a rank later in the pass than another's line posted
    that line's collective itself, so its being further along says nothing of a skip."""
    for laps in (False, True):
        found = [sh for r, c in sorted(entries.items()) if c is not None
                 and (sh := shift_at(c, r, ctx, laps)) is not None]
        if found:
            return found
    return []


def shift_at(w: Collective, waiter: int, ctx: Context, laps: bool) -> Shift | None:
    """The two readings of a count shift at the line ``waiter`` posted ``w`` from: the ranks
    waiting in ``w`` there (ahead), and the ranks past that line in the same pass (or, with
    ``laps``, a pass on) that posted it themselves as a lower number, all at one count."""
    views = ctx.views
    if w.seq is None:
        return None
    fb = list(at(w, views[waiter]))
    if not fb:
        return None

    def here(v: RankView) -> bool:
        return v.current is not None and (v.current.pg, v.current.seq) == (w.pg, w.seq)

    ahead = sorted(r for r, v in views.items() if here(v) and list(at(v.current, v)) == fb)
    theirs = [views[a].tl.enqueued for a in ahead]
    passed: list[int] = []
    counts: set[int] = set()
    after = False
    for r, v in views.items():
        # a rank at w's number at another line is no side: whether it is in the waiters'
        # pass (then it posted the line's collective below) or a pass behind, nothing says
        # — unless the source does (it left their loop for good; or the other reading would
        # need two differences, not one: the three readers below)
        posted = v.tl.enqueued.get(w.pg, -1)
        if here(v) and r not in ahead and (_left_after(views, v, fb) or (
                w.pg == DEFAULT_PG and (_later_in_pass(ctx, v, fb) or _a_pass_on(ctx, v, fb)))):
            passed.append(r)  # it posted the line's collective before its own, now at w.seq
            counts.add(w.seq - 1)
            after = True
            continue
        if r in ahead or here(v) or w.pg not in v.tl.by_pg or not 0 <= posted < w.seq:
            continue
        if went_through(views.source, list(v.position), fb, v.current if laps else None,
                        theirs) and (w.pg == DEFAULT_PG
                                 or _counts_allow(views.source, fb[-1], v, theirs)):
            passed.append(r)
            counts.add(posted)
    if not ahead or not passed or len(counts) != 1:
        return None
    ahead_t, passed_t = tuple(sorted(ahead)), tuple(sorted(passed))
    # where their own recorders hold call sites: a line none of their earlier steps posted
    # from, since they last posted the shift's line, is their extra
    extra_src, skip_src = _branch_says(views.source, w, fb[-1], ahead_t, passed_t)
    extra_given = {**COUNTS_ONLY, CulpritBasis.SOURCE: extra_src}
    if all(_new_line(views[a], w, fb) for a in ahead):
        extra_given[CulpritBasis.HISTORY] = True
    readings = (Reading(ahead_t, passed_t, Edit.EXTRA, mine=w, given=extra_given),
                Reading(passed_t, ahead_t, Edit.SKIP, theirs=w,
                        given={**COUNTS_ONLY, CulpritBasis.SOURCE: skip_src}))
    return Shift(w.op, w.pg, w.pg_desc, w.seq, counts.pop(), ahead_t, passed_t, fb[-1],
                 readings, same_seq=after)


def _branch_says(src: SourceFacts, w: Collective, at: Frame, ahead: tuple[int, ...],
                 passed: tuple[int, ...]) -> tuple[bool | None, bool | None]:
    """What the source says of the extra and the skip reading: the loop's one call on the
    default group a branch decides, under a rank condition, is the only way a pass posts one
    more or one fewer there. One that names who runs it (``if FAULTY and step == 2:``) makes
    the ahead side's count its extra, where they may take it and the passed side may not;
    one that names who does not (``if rank != 3:``), the passed side's skip."""
    way = branch_call(src, at) if w.pg == DEFAULT_PG else None
    cond = rank_condition(src, way.file, way.line) if way is not None else None
    if cond is None or not taken_only_by(cond, ahead, passed):
        return None, None
    return (False, True) if excludes_ranks(cond) else (True, False)


def _new_line(v: RankView, w: Collective, fb: list[Frame]) -> bool:
    """``v`` posted, on ``w``'s group after it last posted from ``fb`` and before ``w``, a
    collective from a line none of its entries before came from (its recorder's call sites)."""
    here, entries = tuple((f.file, f.line) for f in fb), v.tl.by_pg.get(w.pg, {})
    last = max((s for s, c in entries.items() if w.seq is not None and s < w.seq
                and user_line(c) == here), default=None)
    if last is None or w.seq is None:
        return False
    return any(user_line(c) for c in new_posts(entries, last + 1, w.seq))


def _later_in_pass(ctx: Context, v: RankView, fb: list[Frame]) -> bool:
    """``v`` waits, as the number the others wait in at ``fb`` on the default group, at a
    later line of their pass (its frames at ``fb``'s depth later in the loop's body; ``fb``
    a line every pass posts): it posted ``fb``'s collective as a lower number. Or the others
    are a pass on, having left their last pass early past ``v``'s line (a ``continue``, one
    edit): read only where a collective every pass posts follows ``v``'s line in the body,
    which they could not have left out."""
    src, b = ctx.views.source, fb[-1]
    mine = list(v.position)[:len(fb)]
    if len(mine) != len(fb) or mine[-1].line <= b.line \
            or not went_through(src, mine, fb, None, []):
        return False
    return _unconditional(src, b, mine[-1].line, None)


def _a_pass_on(ctx: Context, v: RankView, fb: list[Frame]) -> bool:
    """``v`` waits, as the number the others wait in at ``fb`` (a line every pass posts) on
    the default group, at an earlier line of the loop (its frames at ``fb``'s depth): a pass
    on, it posted ``fb``'s collective in their pass as a lower number. Or it is in their
    pass, behind, at their count: they went through every collective from its line to
    theirs, so it posted as many more before — read only where one that every pass posts
    lies between the two lines: with its own, that is two or more, where the one edit of
    a silent pairing differs by one."""
    src, b = ctx.views.source, fb[-1]
    mine = list(v.position)[:len(fb)]
    if len(mine) != len(fb) or not alike(mine, fb) or mine[-1].line >= b.line \
            or not every_pass(src, b, mine[-1]):
        return False
    return _unconditional(src, b, mine[-1].line, b.line)


def _unconditional(src: SourceFacts, b: Frame, after: int, before: int | None) -> bool:
    """A collective on the default group that every pass of the loop around ``b`` posts
    (no branch, no guard before it), called by name after line ``after`` (and before line
    ``before``)."""
    body = loop_step(src, b.file, b.line, after)
    return body is not None and any(
        after < c and (before is None or c < before) and every_pass(src, replace(b, line=c), b)
        and (lf := src.line(b.file, c)) is not None and lf.default_group is True
        for c in body.calls)


def _left_after(views: RankViews, v: RankView, fb: list[Frame]) -> bool:
    """``v`` waits, as the number the others wait in at ``fb``, in the statement right after
    the loop around ``fb`` (no collective between the two), a loop it left for good: in its
    last pass it posted ``fb``'s collective (every pass does) as a lower number. Fewer passes
    alone does not leave it there: every pass of ``fb``'s loop posts at least two collectives
    on the default group up to ``fb`` (as the source calls them by name), so a rank behind
    by passes is at least two behind, and ``v`` is one: it went through the others' pass."""
    src, b = views.source, fb[-1]
    mine = v.position
    if not mine or mine[-1].file != b.file or v.current is None or v.current.pg != DEFAULT_PG:
        return False
    left = loop_between(src, v.stack.frames, [list(reversed(fb))], for_good=True)
    body = loop_step(src, b.file, b.line, b.line)
    if left is None or body is None or left.line != body.line:
        return False
    lf_b, lf_a = src.line(b.file, b.line), src.line(b.file, mine[-1].line)
    if lf_b is None or lf_a is None or not every_pass(src, b, b) \
            or lf_b.default_group is not True or lf_a.default_group is not True:
        return False
    at = next((i for i, st in enumerate(lf_a.path) if st.line == body.line), None)
    loop = next((k for k, st in enumerate(lf_b.path) if st.line == body.line), None)
    nxt = lf_a.path[loop] if loop is not None and loop < len(lf_a.path) else None
    if at is not None or loop is None or nxt is None or len(lf_a.path) != loop + 1 \
            or (nxt.block, nxt.field, nxt.index) != (body.block, body.field, body.index + 1):
        return False
    upto = [n for n in body.calls if n <= b.line and (lf := src.line(b.file, n)) is not None
            and lf.default_group is True and every_pass(src, Frame(b.file, n, b.function), b)]
    return len(upto) >= 2


def _counts_allow(src: SourceFacts, fb: Frame, v: RankView,
                  theirs: list[dict[str, int]]) -> bool:
    """Being at its line in the waiters' pass (or the pass on) leaves the rank's count on the
    default group at least theirs plus the collectives on it that every pass posts from
    their line ``fb`` on to its own, as the source shows them (called by name: a helper's
    only add). Fewer, and it is not there without a second difference of its own (it is a
    pass behind, say, after an extra there): a shift on another group is read only where
    the counts on the group both sides share agree with it."""
    got = {t.get(DEFAULT_PG) for t in theirs}
    fa = v.position[-1] if v.position else None
    if fa is None or fa.file != fb.file or len(got) != 1 or None in got:
        return True  # no position, or no one count of theirs: nothing to check it against
    body = loop_step(src, fb.file, fb.line, fa.line)
    if body is None:
        return True
    wrap = fa.line <= fb.line  # a pass on: from their line to the body's end, then its start
    need = 0
    for line in body.calls:
        if not (fb.line < line <= fa.line or (wrap and (line > fb.line or line <= fa.line))):
            continue
        lf = src.line(fb.file, line)
        if lf is not None and lf.default_group and every_pass(src, Frame(fb.file, line,
                                                                         fb.function), fb):
            need += 1
    (count,) = got
    return count is None or v.tl.enqueued.get(DEFAULT_PG, -1) >= count + need


def shifted(sh: Shift, views: RankViews) -> tuple[Verdict, str, Advice]:
    """The sentence and the advice. How many more: not said — a collective on G between the
    line and where the passed ranks are counts in their number too."""
    group = pg_label(sh.pg, sh.pg_desc)
    c, o = sh.culprits, sh.others
    line = site_str(sh.site)
    said = (f" {who(sh.passed).capitalize()} went through {line} in the pass "
            f"{who(sh.ahead)} {agree(sh.ahead, 'is', 'are')} in, posting its collective as "
            f"{group}#{sh.passed_seq} at the latest; "
            f"{agree(sh.ahead, 'it waits', 'they wait')} in its {sh.op} as #{sh.seq}: ")
    if sh.extra:
        said += (f"{who(c)} posted more collectives on {group} before it than "
                 f"{who(o)} (an extra, paired silently with their next of the same size).")
    else:
        said += f"{who(c)} posted fewer on {group} before it than {who(o)} (a skip)."
    return Verdict.DESYNC, said, count_advice(c, o, group, sh.site, sh.extra, views.source,
                                              sh.pg_desc == "default_pg")


def count_advice(c: list[int], o: list[int], group: str, at: Frame, extra: bool,
                 src: SourceFacts, default: bool) -> Advice:
    """One side posted more collectives on ``group`` before line ``at`` than the other (an
    extra, or a skip of the other side's): what to change, and — ``group`` the default
    one — the one collective of the loop on it that a branch decides, where the source
    shows one."""
    line = site_str(at)
    if extra:
        text = (f"{who(c).capitalize()} posted more collectives on {group} than {who(o)} "
                f"before {line}: one that runs on {agree(c, 'it', 'them')} only (a log, a "
                "metric, a check under a condition on the rank). Post it on every rank of "
                "the group, or on a group of its own.")
    else:
        text = (f"{who(c).capitalize()} posted fewer collectives on {group} than {who(o)} "
                f"before {line}: one the others post, skipped there (an `if` or `continue` "
                "on the rank's own data). Post every collective of a pass on every rank.")
    site = branch_call(src, at) if default else None
    if site is not None:
        text += f" The one under a branch in this loop on {group}: {site_str(site)}."
    return Advice(text, site=site, site_why=None if site is None else
                  f"the only collective on {group} of the loop that a branch decides")
