"""The loops the ranks are at (docs/DESIGN.md §8, advice): a culprit past a loop the others
are still in (they ran different numbers of passes, or it cut one short), or still inside
one the others have left (one more pass, or the collective after it skipped) — pure."""

from __future__ import annotations

from moe_hang.analysis.diagnosis import CulpritBasis
from moe_hang.analysis.situation import Advice, Situation, at_line, collective_of_ranks
from moe_hang.analysis.source import common_loop, gates, in_loop, left_loop
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame, short_path
from moe_hang.evidence.vocab import agree, who


def advise_loop_left(s: Situation, loop: Frame) -> Advice:
    """The culprits are past a loop the others are still in (``loop``: its ``file:line``)."""
    missed_at = next((s.site(r) for r in s.waiting() if s.site(r) is not None), None)
    missed = at_line(missed_at) if missed_at else collective_of_ranks(s, s.waiting())
    return Advice(f"{who(s.culprits).capitalize()} left the loop at {loop_at(loop)} while "
                  f"{who(s.waiting())} {agree(s.waiting(), 'is', 'are')} still in it "
                  f"({missed}): the ranks ran different numbers of iterations, or "
                  f"{who(s.culprits)} cut one short before its collectives (a `continue` "
                  "or `break` on a rank's own data). Give each the same count: equal data "
                  "shards (DistributedSampler), or all-reduce the count with MIN first; "
                  "skip an update, never an iteration's collectives.")


def advise_loop_stayed(s: Situation, loop: Frame, now: str, missed: str) -> Advice:
    """The culprits are inside a loop the others have left (``loop``: its ``file:line``):
    at that seq they posted the loop's collective where the others (and, by history, they
    themselves in every earlier step) posted the one after it. One more pass, or the one
    after it skipped and the next pass begun: the collectives of the two are the same; a
    live rank's loop counters tell them apart."""
    earlier = (f" (as {who(s.culprits)} {agree(s.culprits, 'itself', 'themselves')} did "
               "in every earlier step)") * (s.basis == CulpritBasis.HISTORY)
    return Advice(f"{who(s.culprits).capitalize()} posted at {now} (inside the loop at "
                  f"{loop_at(loop)}) where {who(s.waiting())} posted {missed}, after the loop"
                  f"{earlier}: {agree(s.culprits, 'it', 'they')} ran the loop more times (a "
                  "count from a rank's own data: micro-batches, samples) or skipped that "
                  "collective. Give every rank the same count (all-reduce it with MAX "
                  "first, pad), and never skip a collective on one rank; a live rank's "
                  "loop counters (`moe-hang diagnose`) tell which.", site=loop,
                  site_why="the loop whose count differs")


def stayed(s: Situation) -> Frame | None:
    """The loop every culprit is still in, at one line it posts from on every pass, that
    every waiting rank has left for one line after it; None otherwise. A line under a gate
    inside the loop (``if overflow: all_reduce(flag)``), or one the culprit's collective
    before did not come from, is no pass of the loop: an extra, not one more pass."""
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
        if prev is not None and (prev.file, prev.line) != (site.file, site.line):
            return None
    return loop


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
