"""Where the source places a collective a rank's recorder holds no call site for, posted by
the stack's thread right before the collective its stack is in: the one it is held behind
(``async_op=True``, gloo running a group's collectives in order), or the one it completed just
before. A rank's line is where its pending collective was posted (docs/DESIGN.md §8)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from moe_hang.analysis.program import signature
from moe_hang.analysis.source import every_pass, function_step, loop_step, periodic_gate
from moe_hang.analysis.timeline import RankTimeline, RankViews
from moe_hang.evidence.flight_recorder import DEFAULT_PG, Collective
from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, StackView, is_library_frame, other_thread


def held_behind(sv: StackView, facts: SourceFacts | None, pending: list[Collective]
                 ) -> StackView | None:
    """Two collectives pending on one group, the second the number right after the first, and
    the stack in the second's op (not the first's), by the thread that posted both: gloo runs
    a group's collectives in order, so the rank is held behind the first, posted earlier
    (``async_op=True``). Its recorder holds no call site for it; where the source places it
    (:func:`_call_before`), that is its line (a rank's line is where its pending collective
    was posted)."""
    if len(pending) != 2 or sv.op is None or sv.waited_at is not None:
        return None
    first, then = pending
    # the same op: the stack is in the second's call only where the thread that posted both
    # is known to be the stack's (it posted the second after returning from the first)
    known = sv.thread_id is not None and all(c.thread_id for c in pending)
    if first.frames or first.pg != then.pg or first.seq is None or then.seq != first.seq + 1 \
            or normalise_op(then.op) != sv.op \
            or (normalise_op(first.op) == sv.op and not known) \
            or any(other_thread(c.thread_id, sv.thread_id) for c in pending):
        return None
    got = _call_before(sv, facts, first)
    if got is None:
        return None
    k, posted = got
    return replace(sv, op=normalise_op(first.op), api=posted[1], callsite=posted[0],
                   frames=[posted[0], *sv.frames[k + 1:]])


def _call_before(sv: StackView, facts: SourceFacts | None, c: Collective
                 ) -> tuple[int, tuple[Frame, str]] | None:
    """Where the source places ``c``, posted by the stack's thread right before the
    collective its stack is in: the last call before the stack's line in its loop's pass, by
    name, with nothing between (the stack's frames inside that line show none by name before
    theirs), every pass posting it on ``c``'s group kind with ``c``'s op. (the index of the
    stack's frame in its loop, (the line, the call's name)); None where that is not read."""
    if facts is None:
        return None
    for k, f in enumerate(sv.frames):
        if is_library_frame(f):
            continue
        body = loop_step(facts, f.file, f.line, f.line)
        if body is None:
            fn = function_step(facts, f.file, f.line)
            if fn is None or any(fn.line < n < f.line for n in fn.calls):
                return None  # module level outside a loop, or a call before it unread
            continue
        calls = [n for n in body.calls if n < f.line][::-1] \
            + [n for n in body.calls if n > f.line][::-1]
        lf = facts.line(f.file, calls[0]) if calls else None
        if lf is None or lf.call is None or normalise_op(lf.call) != normalise_op(c.op) \
                or lf.default_group is not (c.pg == DEFAULT_PG) \
                or not every_pass(facts, Frame(f.file, calls[0], f.function), f):
            return None
        return k, (Frame(f.file, calls[0], f.function), lf.call)
    return None


def posted_before(tl: RankTimeline, sv: StackView, current: Collective | None,
                   facts: SourceFacts | None) -> tuple[Collective, Frame] | None:
    """The collective the rank posted right before the one its stack is in (the recorder's
    order, every group), where the recorder holds no call site for it and the rank has gone
    on (it completed, or gloo aborted it): placed by the source (:func:`_call_before`) — the
    line of a completed collective is where the stack's thread posted it, not where its stack
    is now."""
    if current is None or current.record_id is None or sv.op != normalise_op(current.op) \
            or sv.waited_at is not None or other_thread(current.thread_id, sv.thread_id):
        return None
    before = [c for coll in tl.by_pg.values() for c in coll.values()
              if c.record_id is not None and c.record_id < current.record_id]
    if not before:
        return None
    prior = max(before, key=lambda c: c.record_id or 0)
    if prior.record_id != current.record_id - 1 or prior.frames or prior.source == "probe" \
            or other_thread(prior.thread_id, sv.thread_id):
        return None
    got = _call_before(sv, facts, prior)
    return None if got is None else (prior, got[1][0])


def user_line(c: Collective) -> tuple[tuple[str, int], ...]:
    """The user lines (its recorder's call sites, outermost first) that posted ``c``."""
    return tuple((f.file, f.line) for f in reversed(c.frames) if not is_library_frame(f))


def new_posts(entries: Mapping[int, Collective], lo: int, hi: int) -> list[Collective]:
    """Of one rank's entries on one group, those at ``lo`` .. ``hi - 1`` posted from user
    lines none of its entries before ``lo`` came from."""
    before = {user_line(c) for q, c in entries.items() if q < lo}
    return [c for q, c in sorted(entries.items()) if lo <= q < hi and user_line(c) not in before]


def placed_in_run(pg: str, start: int, having: Sequence[int], lacking: Sequence[int],
                  views: RankViews) -> int | None:
    """A block of one collective alike the run right before it on every rank may sit anywhere
    in that run (gloo paired them silently), where the lacking side's carry no call site:
    the having side's own call sites place it where one entry of the run, the same on each,
    comes from a line none of its entries before the run came from — and not one that comes
    due at some passes only (``if step % 4 == 0:``, new on every rank alike). Its seq,
    where it is not the block's own; else None."""
    tls = {r: views[r].tl.by_pg.get(pg, {}) for r in (*having, *lacking)}
    if (first := tls[having[0]].get(start)) is None:
        return None
    sig, s = signature(first), start
    while all((c := tl.get(s - 1)) is not None and signature(c) == sig for tl in tls.values()):
        s -= 1
    if s == start or any(tls[r][q].frames for r in lacking for q in range(s, start)):
        return None  # no run, or the lacking side's code placed the block already
    found = set()
    for r in having:
        run = [c for q in range(s, start + 1) if (c := tls[r].get(q)) is not None]
        new = new_posts(tls[r], s, start + 1)
        if len(run) != start + 1 - s or not all(user_line(c) for c in run) or len(new) != 1 \
                or any(periodic_gate(views.source, f, n) for f, n in user_line(new[0])):
            return None
        found.add(new[0].seq)
    q = found.pop() if len(found) == 1 else None
    return q if q != start else None
