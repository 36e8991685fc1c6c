"""The data decision behind a skip (docs/DESIGN.md §8, advice): a culprit that posted its
last agreed collective from a line of a function the others' next collective was posted
through, and never posted that one, went past it through one of the *gates* the source
shows between the two lines — an ``if`` the collective (or the call leading to it) sits in,
a guard that leaves early (``if remote == 0: return``). Where the source shows exactly one,
that is the branch the culprit took and the others did not. Pure."""

from __future__ import annotations

from moe_hang.analysis.situation import Advice, Situation, at_line
from moe_hang.analysis.source import (
    every_pass,
    excludes_ranks,
    gates,
    loop_step,
    loop_targets,
    on_every_rank,
    periodic_gate,
    rank_condition,
    taken_only_by,
)
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.source import Gate, SourceFacts
from moe_hang.evidence.stacks import Frame, callsite, is_library_frame, short_path
from moe_hang.evidence.vocab import agree, who


def gates_passed(s: Situation, culprit: int, missed: list[Frame], now: list[Frame]
                 ) -> list[tuple[Frame, Gate]]:
    """The ways past the others' collective the source shows, each with the frame it is in:
    ``missed`` is the stack that posted it (innermost first), ``now`` the culprit's. In the
    innermost function both it and the culprit's last agreed collective were posted from,
    the gates between the two lines; in the calls below that one (which the culprit may
    never have made), every gate on the way. Empty where they share no function, where the
    culprit's own line now lies between the two (it may have posted an extra there, not
    skipped anything), or where a rank condition decides it (that advice says it)."""
    prev = [f for f in s.before.get(culprit, []) if not is_library_frame(f)]
    mine = [f for f in missed if not is_library_frame(f)]
    shared = [(d, fm, fp) for d, fm in enumerate(mine) for fp in prev
              if (fp.file, fp.function) == (fm.file, fm.function)]
    # the innermost function both were posted through — but where both came from one line
    # of it that nothing there repeats (a layer called once a step), the lap between
    # them is an outer frame's: the first shared frame out where they differ, or a loop does
    common = next(((d, fm, fp) for d, fm, fp in shared if fp.line != fm.line
                   or loop_step(s.src, fm.file, fp.line, fm.line) is not None),
                  shared[0] if shared else None)
    if common is None:
        return []
    depth, fm, fp = common
    here = [f.line for f in now if (f.file, f.function) == (fm.file, fm.function)]
    lap = None
    if fp.line < fm.line:
        since = fp.line
        if any(fp.line < n < fm.line for n in here):
            return []
    else:
        # its last agreed collective was at this line or a later one, a lap of a loop
        # holding both before: the way round is from the loop's top down to the line —
        # unless the culprit is still in that lap (a later line, with no count saying it is
        # in the others' pass: then it may have posted an extra there, not skipped)
        lap = loop_step(s.src, fm.file, fp.line, fm.line)
        if lap is None or any(lap.line < n < fm.line or (
                fp.line < n <= lap.end and not _in_their_pass(s, culprit, fm, n))
                for n in here):
            return []
        since = lap.line
    if any(rank_condition(s.src, f.file, f.line) is not None for f in mine[:depth + 1]):
        return []
    out = [(fm, g) for g in gates(s.src, fm.file, fm.line) if g.line > since]
    for f in mine[:depth]:
        out += [(f, g) for g in gates(s.src, f.file, f.line)]
    if lap is not None and out and not any(lap.line < n <= lap.end for n in here):
        # fewer laps of the loop is the other way past it (where the lap holds no gate,
        # the loop's own advice says so) — only for a culprit outside the loop now: one
        # inside it (past the exclusions above) passed the skipped line in this very lap,
        # whatever loops enclose it, so a gate let it past, not the loop's count
        out.append((fm, Gate(lap.line, lap.end, lap.header or "the loop", LAPS)))
    return out


def _in_their_pass(s: Situation, culprit: int, fm: Frame, n: int) -> bool:
    """The culprit, at line ``n`` of the loop's body past the others' line ``fm``, is in
    their pass: it waits there in a collective every pass posts (its statement right in the
    body) as #k on its group, where every waiting rank has posted #k-1 there — one pass
    through that line fewer, being earlier in the same pass. Then it went through ``fm``'s
    line in this pass without posting what the others did: a way past it was taken there."""
    rep = s.reports.get(culprit)
    c = rep.collective if rep is not None else None
    if c is None or c.seq is None or not s.waiting():
        return False
    return every_pass(s.src, Frame(fm.file, n, fm.function), fm) and all(
        s.enqueued.get(w, {}).get(c.pg) == c.seq - 1 for w in s.waiting())


LAPS = "laps"  # a pseudo-gate: fewer laps of the loop (``test``: its header)


def gate_code(g: Gate) -> str:
    """Gate ``g`` as the source spells it."""
    if g.how == LAPS:
        return f"fewer laps of `{g.test}:`"
    if g.how == "if":
        return f"`if {g.test}:` around it"
    if g.how == "else":
        return f"the `else` of `if {g.test}:` around it"
    if g.how.startswith("except-"):  # a handler that leaves: the exception is the decision
        return f"`except {g.test}: ... {g.how.removeprefix('except-')}`"
    return f"`if {g.test}: {g.how}`"


def waiters_op(s: Situation) -> str:
    """The op the waiting ranks posted at the divergence (``collective`` where unknown)."""
    return next((c.op for r, c in s.div.per_rank.items() if r in s.waiting() and c),
                "") or "collective"


def advise_gate(s: Situation, culprit: int, missed: Frame, found: list[tuple[Frame, Gate]],
                last: str | None = None) -> Advice:
    """The branch that let ``culprit`` past the collective the others posted at ``missed``
    (``last``: what the ways are counted from, where not its last collective)."""
    head = f"{who([culprit]).capitalize()} skipped the {waiters_op(s)} at {at_line(missed)}"
    last = last or f"(counted from its last collective, at {at_line(callsite(s.before[culprit]))})"
    me, others = who([culprit]), who(s.waiting())
    if len(found) == 1:
        f, g = found[0]
        # an `if` around it is passed by its test, not taken
        took = {"if": f"false on {me}, true on {others}",
                "else": f"true on {me}, false on {others}"}.get(
            g.how, f"taken by {me}, not by {others}")
        return Advice(
            f"{head}: the one way past it the source shows is {gate_code(g)} "
            f"({short_path(f.file)}:{g.line}), {took} {last}. Post it on every rank whatever "
            "the data (an empty tensor if need be), or decide the branch alike on every rank.",
            site=Frame(f.file, g.line, f.function), site_why=f"the branch {me} took")
    ways = "; ".join(f"{gate_code(g)} ({short_path(f.file)}:{g.line})" for f, g in found)
    return Advice(
        f"{head}: the source shows {len(found)} ways past it ({ways}), and {me} took one "
        f"that {others} did not {last}. Post it on every rank whatever the data, or decide "
        "those branches alike on every rank.")


def gate_taken(s: Situation, now: Frame, missed: Frame) -> Gate | None:
    """The ``if`` (or its ``else``) the culprits' own collective sits in and the others'
    does not, in the function both were posted from: where the culprit's collective is the
    extra, the branch its data took (``if overflow(g): all_reduce(flag)``). None where a
    rank condition decides it (that advice says it) or the source shows none."""
    if (now.file, now.function) != (missed.file, missed.function) \
            or rank_condition(s.src, now.file, now.line) is not None:
        return None
    theirs = set(gates(s.src, missed.file, missed.line))
    return next((g for g in gates(s.src, now.file, now.line)
                 if g.how in ("if", "else") and g not in theirs), None)


def gates_a_pass_on(s: Situation, culprit: int, missed: Frame, now: Frame
                    ) -> tuple[list[tuple[Frame, Gate]], str]:
    """Stacks alone: the culprit at ``now`` is a pass on in the innermost loop holding both
    lines (its counter one more than every waiting rank's, py-spy's), so it went through the
    others' line at ``missed`` in their pass without posting there: the gates of that line
    inside the loop are its ways past. Empty where the counters do not say so, the lines are
    in different functions, or a rank condition decides it (that advice says it)."""
    body = loop_step(s.src, missed.file, missed.line, now.line)
    names = loop_targets(body.header) if body is not None else []
    if body is None or len(names) != 1 or (missed.file, missed.function) != (
            now.file, now.function) or rank_condition(s.src, missed.file, missed.line):
        return [], ""
    mine = s.counters.get(culprit, {}).get(names[0])
    theirs = {s.counters.get(w, {}).get(names[0]) for w in s.waiting()}
    if mine is None or len(theirs) != 1 or (n := theirs.pop()) is None or mine != n + 1:
        return [], ""
    return ([(missed, g) for g in gates(s.src, missed.file, missed.line) if g.line > body.line],
            f"(a pass on: its `{names[0]}` is {mine}, theirs {n})")


def gates_in_their_pass(s: Situation, culprit: int, missed: list[Frame], now: list[Frame]
                        ) -> tuple[list[tuple[Frame, Gate]], str]:
    """The culprit is not in the function the others' collective was posted in (stacks
    ``missed``, ``now``: innermost first) and, at an outer frame both share by the same
    calls, is at a later line of the very pass they are in (the loop's counter equal,
    py-spy's): it went past their call in this pass — whatever it posted from that call in
    an earlier pass. The gates of that call inside the loop, and every gate on the way down
    to their collective, are its ways past. Empty where the counters do not say so, or a
    rank condition decides it (that advice says it)."""
    mine = [f for f in missed if not is_library_frame(f)]
    here = [f for f in now if not is_library_frame(f)]
    if not mine or any((f.file, f.function) == (mine[0].file, mine[0].function)
                       for f in here):
        return [], ""
    for depth, fm in enumerate(mine):
        k = next((i for i, f in enumerate(here)
                  if (f.file, f.function) == (fm.file, fm.function)), None)
        if k is None:
            continue
        fn = here[k]
        body = loop_step(s.src, fm.file, fm.line, fn.line)
        # the loop's integer counters py-spy read (``for step, (x, y) in ...``: step)
        names = [v for v in (loop_targets(body.header) if body is not None else [])
                 if v in s.counters.get(culprit, {})]
        outer = [(f.file, f.function, f.line) for f in mine[depth + 1:]]
        if body is None or len(names) != 1 or fn.line <= fm.line or outer != [
                (f.file, f.function, f.line) for f in here[k + 1:]] or any(
                rank_condition(s.src, f.file, f.line) for f in mine[:depth + 1]):
            return [], ""
        n = s.counters.get(culprit, {}).get(names[0])
        if n is None or {s.counters.get(w, {}).get(names[0]) for w in s.waiting()} != {n}:
            return [], ""
        # not a guard that leaves the pass (it went on to its line in it), nor a block it
        # is in itself
        out = [(fm, g) for g in gates(s.src, fm.file, fm.line) if g.line > body.line
               and g.how in ("if", "else") and not g.line <= fn.line <= g.end]
        for f in mine[:depth]:
            out += [(f, g) for g in gates(s.src, f.file, f.line)]
        return out, f"(in their pass: its `{names[0]}` is {n}, as theirs)"
    return [], ""


def one_line(s: Situation, at: Frame) -> bool:
    """Every culprit posted its collective from ``at``."""
    return all(s.site(r) == at for r in s.culprits)


def in_step(s: Situation) -> bool:
    """Every rank posted its collective before the divergence on its group from one line (by
    the same calls): they were in step there."""
    ranks = [*s.culprits, *s.waiting()]
    paths = [tuple(f for f in s.before.get(r, []) if not is_library_frame(f)) for r in ranks]
    return bool(paths) and all(paths) and len(set(paths)) == 1


def advise_gate_taken(s: Situation, now: Frame, missed: Frame, g: Gate) -> Advice:
    """The culprits, every one at ``now``, took the branch ``g`` the others at ``missed``
    did not."""
    me, others = who(s.culprits), who(s.waiting())
    its = "its" if len(s.culprits) == 1 else "their"
    branch = f"`if {g.test}:`" if g.how == "if" else f"the `else` of `if {g.test}:`"
    held = "held" if g.how == "if" else "failed"
    return Advice(
        f"{me.capitalize()} posted at {at_line(now)}, in {branch} "
        f"({short_path(now.file)}:{g.line}), where {others} posted {at_line(missed)}: the "
        f"test {held} on {me} alone ({its} own data). Decide it alike on every rank "
        "(all-reduce what it tests first), or post that collective on every rank whatever "
        "the data.", site=Frame(now.file, g.line, now.function),
        site_why=f"the branch {me} took")


def went_through(src: SourceFacts, fa: list[Frame], fb: list[Frame], mine: Collective | None,
                 theirs: list[dict[str, int]]) -> bool:
    """The rank at ``fa`` posted ``fb``'s collective in the pass the ranks at ``fb`` are in
    (user frames, outermost first, the outer ones alike; a line of one loop's body that every
    pass posts, :func:`every_pass`): it is later in that pass, or a pass on — at an earlier
    line, waiting in ``mine`` (posted every pass too) as a number they, by their counts per
    group ``theirs``, have not reached. Then it posted that line's collective itself, under
    another sequence number where the counts differ: it skipped nothing there (who has more
    or fewer is decided elsewhere)."""
    if not alike(fa, fb):
        return False
    a, b = fa[-1], fb[-1]
    if b.line < a.line:
        return every_pass(src, b, a)
    return a.line < b.line and mine is not None and mine.seq is not None \
        and every_pass(src, b, a) and every_pass(src, a, b) \
        and any(t[mine.pg] < mine.seq for t in theirs if mine.pg in t)


def alike(fa: list[Frame], fb: list[Frame]) -> bool:
    """Two positions (user frames, outermost first) in one function by the same calls."""
    return len(fa) == len(fb) > 0 and all(
        (x.file, x.function, x.line) == (y.file, y.function, y.line)
        for x, y in zip(fa[:-1], fb[:-1], strict=True)) \
        and (fa[-1].file, fa[-1].function) == (fb[-1].file, fb[-1].function)


def ways_left_out(src: SourceFacts, at: Frame, takers: tuple[int, ...] | list[int],
                  left: tuple[int, ...] | list[int]) -> list[tuple[Frame, Gate]]:
    """In the loop around ``at``, every collective on a group of every rank that a pass may
    post or not sits under a rank condition that leaves ranks out (``if not (rank == r and
    step == 2):``, one ``left`` may be left out of and ``takers`` not) or under a test alike
    in a pass: those lines, each with its condition's gate — the only ways the loop has for
    one rank to post fewer of them than another, and none to post more. Empty where the
    source shows none, or a branch any rank may take alone (one more, or one fewer).
    (Collectives the source does not call by name are not seen: a condition that names who
    runs a helper goes unnoticed, so only a condition that leaves ranks out is read as a
    way.)"""
    body = loop_step(src, at.file, at.line, at.line)
    if body is None:
        return []
    found = []
    for c in body.calls:
        if on_every_rank(src, at.file, c) is not True or not gates(src, at.file, c):
            continue
        cond = rank_condition(src, at.file, c)
        g = next((g for g in gates(src, at.file, c) if g.how in ("if", "else")), None)
        if cond is not None and g is not None and excludes_ranks(cond) \
                and taken_only_by(cond, takers, left):
            found.append((Frame(at.file, c, at.function), g))
        elif periodic_gate(src, at.file, c) is None:
            return []
    return found


def advise_left_out(s: Situation, way: tuple[Frame, Gate], now: Frame, missed: Frame
                    ) -> Advice:
    """Stacks alone: the culprits a pass on at ``now``, the others at ``missed`` — the
    culprits did without the collective at the one way the loop has to post one fewer."""
    at, g = way
    me, others = who(s.culprits), who(s.waiting())
    test = f"`if {g.test}:`" if g.how == "if" else f"the `else` of `if {g.test}:`"
    return Advice(
        f"{me.capitalize()} did not take {test} ({short_path(at.file)}:{g.line}), so "
        f"{agree(s.culprits, 'it', 'they')} never posted the {waiters_op(s)} at "
        f"{at_line(at)} that {others} did: {agree(s.culprits, 'its', 'their')} next one on "
        f"that group paired with theirs, and {agree(s.culprits, 'it', 'they')} went on a "
        f"pass, to {at_line(now)}, while {others} {agree(s.waiting(), 'waits', 'wait')} at "
        f"{at_line(missed)}. Post it on every rank whatever the data, or decide the branch "
        "alike on every rank.",
        site=Frame(at.file, g.line, at.function), site_why=f"the branch {me} did not take")
