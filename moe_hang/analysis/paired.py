"""Where the camps of a desync that a count shift explains come from (docs/DESIGN.md §8): the
skip's line, or where the extra met the others' collective — pure."""

from __future__ import annotations

from dataclasses import replace

from moe_hang.analysis.diagnosis import Divergence, MismatchKind, RankCollective
from moe_hang.analysis.program import P2P_OPS
from moe_hang.analysis.rankstate import to_rc
from moe_hang.analysis.shift import Shift
from moe_hang.analysis.source import every_pass, loop_step
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.stacks import Frame


def paired_at(sh: Shift, site: Frame | None, views: RankViews) -> Divergence | None:
    """Where an extra paired silently: the culprits' extra is ``site`` (the one collective on
    the group under a branch in the loop). Between it and the shift's line, in the pass's
    order, the source calls by name only collectives every pass posts on the group, each
    one: the culprits posted the extra that many and one numbers below the line's, and the
    others, one number behind from there on, the first of them (the line's own where there
    are none) as that same number — the two met there, and each later one of the culprits
    met the others' next. The others' count is exact where no call lies between the line and
    where they are now. The recorder's entries at that number must be the lines' ops (where the
    source names them)."""
    if not sh.extra or site is None or sh.passed_seq != sh.seq - 1:
        return None
    line = sh.site
    src = views.source
    body = loop_step(src, line.file, site.line, line.line)
    if body is None or site.file != line.file:
        return None

    def calls_between(lo: int, hi: int) -> list[int]:
        """The calls the source shows (by name) after line ``lo`` and before ``hi`` in the
        pass, in its order — across its end where ``hi`` is not after ``lo``."""
        if lo < hi:
            return [n for n in body.calls if lo < n < hi]
        return [n for n in body.calls if n > lo] + [n for n in body.calls if n < hi]

    def counted(n: int) -> bool:
        lf = src.line(line.file, n)
        return lf is not None and lf.default_group is True \
            and every_pass(src, Frame(line.file, n, line.function), line)

    def may_post(n: int) -> bool:
        """A call that may number a collective on the group: a send or recv does not (the
        recorder numbers point-to-point apart, gloo's not at all)."""
        lf = src.line(line.file, n)
        return lf is None or (lf.default_group is not False
                              and (lf.call is None or normalise_op(lf.call) not in P2P_OPS))

    between = [n for n in calls_between(site.line, line.line) if may_post(n)]
    # where each of the others is in the loop: its frame in the body (deeper ones are inside
    # that line's call)
    spots = [next((f.line for f in views[a].position if f.file == line.file
                   and loop_step(src, line.file, f.line, line.line) == body), None)
             for a in sh.others]
    # one that left the loop right after it (the shift's passed side at its own number
    # there) went through the rest of its last pass: nothing after the line may post
    rest_silent = not any(may_post(n) for n in body.calls if n > line.line)
    if not all(counted(n) for n in between) or any(
            not (sh.same_seq and rest_silent) if at is None
            else any(may_post(n) for n in calls_between(line.line, at))
            for at in spots if at != line.line):
        return None
    seq = sh.passed_seq - len(between)
    met = between[0] if between else line.line
    per_rank: dict[int, RankCollective | None] = {}
    for r, where in [*((c, site) for c in sh.culprits),
                     *((o, replace(line, line=met)) for o in sh.others)]:
        lf = src.line(where.file, where.line)
        c = views[r].tl.by_pg.get(sh.pg, {}).get(seq)
        if c is None or (lf is not None and lf.call is not None
                         and normalise_op(c.op) != normalise_op(lf.call)):
            return None
        rc = to_rc(c, views[r])
        if rc is None:
            return None
        per_rank[r] = replace(rc, callsite=where)
    members = sorted(r for r, v in views.items() if sh.pg in v.tl.by_pg)
    return Divergence(sh.pg, seq, MismatchKind.EXTRA, sh.pg_desc, members, per_rank)


def skipped_at(sh: Shift, site: Frame | None, views: RankViews) -> Divergence | None:
    """Where a skip a shift reads comes from: the others posted the one collective on the
    group under a branch in the loop (``site``), the culprits did not; in which pass, and so
    as which number, the counts do not say (no number)."""
    if sh.chosen is None or sh.extra or site is None:
        return None
    lf = views.source.line(site.file, site.line)
    if lf is None or lf.call is None:
        return None
    per_rank: dict[int, RankCollective | None] = {c: None for c in sh.culprits}
    members = sorted(r for r, v in views.items() if sh.pg in v.tl.by_pg)
    # the others: the shift's, and every member that posted as many on the group as the
    # side waiting in it (one gone further, past the line in the pass): none skipped it
    further = [r for r in members
               if r not in per_rank and views[r].tl.enqueued.get(sh.pg, -1) >= sh.seq]
    for o in sorted({*sh.others, *further}):
        per_rank[o] = RankCollective(op=normalise_op(lf.call), pg=sh.pg, seq=None,
                                     source="source", pg_desc=sh.pg_desc, callsite=site)
    return Divergence(sh.pg, None, MismatchKind.MISSING, sh.pg_desc, members, per_rank)


def shift_divergence(sh: Shift, site: Frame | None, views: RankViews) -> Divergence | None:
    """Where the camps of a desync come from, for a shift whose passed side is a camp there
    (:attr:`Shift.same_seq`: their own collective is the shift's consequence): the skip's
    line, or where the extra met the others'."""
    if not sh.same_seq:
        return None
    return skipped_at(sh, site, views) or paired_at(sh, site, views)
