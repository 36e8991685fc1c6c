"""Which of two ranks is further along the same code: it went past the collective the other
waits in, i.e. skipped it (docs/DESIGN.md §8). From history first (in earlier iterations, which
call site followed which), then from program order (at the deepest frame both stacks share,
the lower line comes first). Pure."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from moe_hang.evidence.frtrace import Collective
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame

if TYPE_CHECKING:
    from moe_hang.analysis.timeline import RankView


def site_key(c: Collective) -> tuple[str, object] | None:
    site = callsite(c.frames) if c.frames else None
    if site is not None:
        return (site.file, site.line)
    return ("probe", c.name) if c.name else None


def earlier_in_program(fa: list[Frame], fb: list[Frame]) -> str | None:
    """Which of two user stacks (outermost frame first) is earlier in program order: at the
    deepest frame they share, the one on the lower line ("a" or "b"; None: undecided)."""
    for x, y in zip(fa, fb, strict=False):
        if (x.file, x.function) != (y.file, y.function):
            return None
        if x.line != y.line:
            return "a" if x.line < y.line else "b"
    return None


def who_skipped(a: Collective, b: Collective, views: dict[int, RankView],
                ra: list[int], rb: list[int]) -> str | None:
    """Which side posted a *later* collective in place of the other's, i.e. skipped one
    ("a", "b", or None when the evidence does not decide)."""
    ka, kb = site_key(a), site_key(b)
    if ka and kb and ka != kb:
        a_then_b = b_then_a = False
        for v in views.values():
            keys = [site_key(c) for c in sorted(v.tl.by_pg.get(a.pg, {}).values(),
                                                key=lambda c: c.seq)]
            for k1, k2 in pairwise(keys):
                a_then_b |= (k1, k2) == (ka, kb)
                b_then_a |= (k1, k2) == (kb, ka)
        if a_then_b and not b_then_a:
            return "b"  # b's ranks went on to b's call site without posting a's
        if b_then_a and not a_then_b:
            return "a"
    fa = [f for f in reversed(a.frames) if not is_library_frame(f)] if a.frames else []
    fb = [f for f in reversed(b.frames) if not is_library_frame(f)] if b.frames else []
    if not fa:
        fa = views[ra[0]].user_frames_outer_first()
    if not fb:
        fb = views[rb[0]].user_frames_outer_first()
    first = earlier_in_program(fa, fb)
    if first is None:
        return None
    return "b" if first == "a" else "a"  # the side whose line comes later skipped ahead
