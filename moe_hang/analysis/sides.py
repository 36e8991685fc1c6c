"""Which of the camps that stacks alone show in different collectives can all be right at
once: ranks held up on a group of their own are not in conflict with ranks that went past
their line (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from moe_hang.analysis.source import loop_step, on_every_rank
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.stacks import Frame


def _in_loop(views: RankViews, r: int) -> Frame | None:
    """The rank's frame in the body of a loop (its outermost user frame in one)."""
    return next((f for f in views[r].user_frames_outer_first()
                 if loop_step(views.source, f.file, f.line, f.line) is not None), None)


def _held_apart(views: RankViews, behind: list[int], ahead: list[int]) -> bool:
    """Both camps can be right at once: in one pass of one loop, the behind camp's
    collective runs on a group of its own (its ranks wait there for a member of it), and the
    pass calls by name no collective every rank owes between the two lines — the ahead ranks
    completed their own group's (a 2-D mesh: the other tp group's all-reduce) and went on."""
    src = views.source
    fb, fa, cb = _in_loop(views, behind[0]), _in_loop(views, ahead[0]), \
        views[behind[0]].stack.callsite
    if fb is None or fa is None or cb is None or fb.file != fa.file or fb.line >= fa.line \
            or on_every_rank(src, cb.file, cb.line) is not False:
        return False
    body = loop_step(src, fb.file, fb.line, fa.line)
    return body is not None and all(on_every_rank(src, fb.file, n) is False
                                    for n in body.calls if fb.line < n < fa.line)


def sides(views: RankViews, camps: dict[object, list[int]]) -> dict[object, list[int]]:
    """The camps merged where they can all be right at once (:func:`_held_apart`): what
    conflicts is between sides, not between ranks held up on their own groups. A camp
    behind is held up by a member of its group elsewhere: where no rank is left outside the
    merged ones, its group's members are among the ranks ahead, who went past the collective
    it waits in without it — then nothing is merged."""
    keys = list(camps)
    side = {k: k for k in keys}
    for a in keys:
        for b in keys:
            if a is not b and side[a] != side[b] and _held_apart(views, camps[a], camps[b]):
                old, new = side[b], side[a]
                side = {k: new if v == old else v for k, v in side.items()}
    out: dict[object, list[int]] = {}
    for k in keys:
        out.setdefault(side[k], []).extend(camps[k])
    return {k: sorted(rs) for k, rs in out.items()} if len(out) > 1 else camps


def every_rank_side(views: RankViews, camps: dict[object, list[int]]) -> bool:
    """Two sides, one whose every camp's collective runs on a group of every rank."""
    return len(camps) == 2 and any(on_every_rank_all(views, camps, [k]) for k in camps)


def on_every_rank_all(views: RankViews, camps: dict[object, list[int]],
                       keys: Sequence[object]) -> bool:
    """Do these camps' collectives run on the default group, as the source says, so that no
    rank can have completed one without every other rank?"""
    return bool(keys) and all(
        (site := views[camps[k][0]].stack.callsite) is not None
        and on_every_rank(views.source, site.file, site.line) is True for k in keys)
