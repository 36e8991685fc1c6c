"""Where a culprit is against the loop the others are in (docs/DESIGN.md §8, advice): past
it (it left the loop they are still in, by line order at the deepest frame both share, or
returned from the function that holds it), or still in it when they have left — pure. What
to change is :mod:`.loops`'s."""

from __future__ import annotations

from itertools import pairwise

from moe_hang.analysis.readings import user_frames
from moe_hang.analysis.situation import Situation
from moe_hang.analysis.source import common_loop, gates, in_loop, left_loop, loop_step
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame, short_path


def stayed(s: Situation) -> Frame | None:
    """The loop every culprit is still in, at one line it posts from on every pass, that
    every waiting rank has left for one line after it; None otherwise. A line under a gate
    inside the loop (``if overflow: all_reduce(flag)``) is no pass of the loop, nor is one
    where the culprit's collective before came from outside the loop's body (it entered
    the loop again, a pass of a loop around it on): an extra, not one more pass."""
    loops = {loop_left(s, c, stayed=True) for c in s.culprits}
    sites = {s.site(c) for c in s.culprits}
    waited = {s.site(r) for r in s.waiting()}
    if len(loops) != 1 or len(sites) != 1 or len(waited) != 1 or None in waited:
        return None
    loop, site = loops.pop(), sites.pop()
    if loop is None or site is None or any(g.line > loop.line
                                           for g in gates(s.src, site.file, site.line)):
        return None
    for c in s.culprits:
        prev = callsite(s.before[c]) if s.before.get(c) else None
        if prev is not None and not _in_body(s.src, prev, loop):
            return None
    return loop


def _in_body(src: SourceFacts, at: Frame, loop: Frame) -> bool:
    """``at`` is a line of the body of the loop at ``loop`` (its header's frame)."""
    lf = src.line(at.file, at.line) if (at.file, at.function) == (loop.file, loop.function) \
        else None
    path = lf.path if lf is not None else ()
    return any(st.line == loop.line and st.kind in ("For", "AsyncFor", "While")
               and nxt.field == "body" for st, nxt in pairwise(path))


def loop_at(loop: Frame) -> str:
    """``train.py:15``: a loop's header line."""
    return f"{short_path(loop.file)}:{loop.line}"


def loop_left(s: Situation, culprit: int, stayed: bool = False) -> Frame | None:
    """The loop (its header's frame) the culprit left and every waiting rank is still in: at the
    deepest frame the stacks share, the waiters' line is inside a loop the culprit's line
    comes after. ``stayed``: the loop the culprit is still in and every waiting rank left.
    Not where a waiting rank's last collective before the divergence was posted past that
    loop: it came back into the loop round one around it since — a pass on, not still in
    the pass the culprit left (line numbers order statements within one pass only)."""
    loop = loop_between(s.src, s.frames.get(culprit, []),
                        [s.frames.get(r, []) for r in s.waiting()], stayed=stayed)
    if loop is None and not stayed:
        loop = _returned_from(s, culprit)
    if loop is None or stayed:
        return loop
    for r in s.waiting():
        here = [f for f in s.frames.get(r, []) if (f.file, f.function) == (loop.file,
                                                                            loop.function)]
        prev = [f for f in s.before.get(r, []) if (f.file, f.function) == (loop.file,
                                                                             loop.function)]
        if here and prev and left_loop(s.src, loop.file, prev[0].line, here[0].line) \
                == loop.line:
            return None
    return loop


def _returned_from(s: Situation, culprit: int) -> Frame | None:
    """The loop around the waiting ranks' line, in their innermost function, where the
    culprit posted its last agreed collective from that very line by the same calls and has
    since returned from that function (``for x in val_batches(): all_reduce(...)`` with a
    batch fewer): it left the loop they are still in, whatever its line in the caller (a
    pass on there, where line numbers say nothing)."""
    theirs = {user_frames(s.frames.get(r, [])) for r in s.waiting()}
    prev = user_frames(s.before.get(culprit, []))
    if len(theirs) != 1 or not prev or prev != (path := theirs.pop()):
        return None
    inner = path[-1]  # outermost first
    if any((f.file, f.function) == (inner.file, inner.function)
           for f in user_frames(s.frames.get(culprit, []))):
        return None  # still in that function: line order there decides
    body = loop_step(s.src, inner.file, inner.line, inner.line)
    return Frame(inner.file, body.line, inner.function) if body is not None else None


def loop_between(src: SourceFacts, mine: list[Frame], theirs: list[list[Frame]], *,
                 stayed: bool = False, for_good: bool = False) -> Frame | None:
    """:func:`loop_left` of stacks (innermost first). ``for_good``: and no loop holds both
    lines, at that frame or around a frame they share — a rank past the loop then never
    comes round to it again (an epoch loop around it would bring it back)."""
    ours = [f for f in reversed(mine) if not is_library_frame(f)]
    found: set[Frame] = set()
    for stack in theirs:
        other = [f for f in reversed(stack) if not is_library_frame(f)]
        found_at = None
        for a, b in zip(ours, other, strict=False):
            if (a.file, a.function) != (b.file, b.function):
                return None
            if a.line != b.line:
                ahead, behind = (b.line, a.line) if stayed else (a.line, b.line)
                loop = left_loop(src, a.file, ahead, behind)
                if loop and for_good and common_loop(src, a.file, a.line, b.line) is not None:
                    return None
                found_at = Frame(a.file, loop, a.function) if loop else None
                break
            if for_good and in_loop(src, a.file, a.line):
                return None  # a frame both share runs again: they may meet there
        if found_at is None:
            return None
        found.add(found_at)
    return found.pop() if len(found) == 1 else None
