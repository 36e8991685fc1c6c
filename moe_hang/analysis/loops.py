"""The loops the ranks are at (docs/DESIGN.md §8, advice): a culprit past a loop the others
are still in (they ran different numbers of passes, or it cut one short), or still inside
one the others have left (one more pass, or the collective after it skipped) — pure."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.diagnosis import CulpritBasis, pg_label
from moe_hang.analysis.gates import gate_code
from moe_hang.analysis.passes import loop_at
from moe_hang.analysis.situation import (
    Advice,
    Situation,
    at_line,
    collective_of_ranks,
    grad_hook,
)
from moe_hang.analysis.source import (
    alike_in_a_pass,
    branch_call,
    every_pass,
    excludes_ranks,
    gates,
    loop_step,
    loop_targets,
    periodic_gate,
    rank_condition,
    taken_only_by,
)
from moe_hang.evidence.source import Gate, Step
from moe_hang.evidence.stacks import Frame, is_library_frame, short_path
from moe_hang.evidence.vocab import agree, who


def advise_loop_left(s: Situation, loop: Frame) -> Advice:
    """The culprits are past a loop the others are still in (``loop``: its ``file:line``).
    Where the source shows the loop's ways out before its end (its ``break``, a ``return``),
    they are said: one under a rank condition only the culprits take is the decision they
    made alone."""
    missed_at = next((s.site(r) for r in s.waiting() if s.site(r) is not None), None)
    missed = at_line(missed_at) if missed_at else collective_of_ranks(s, s.waiting())
    at: dict[Frame, list[int]] = {}
    for r in s.waiting():
        if (f := s.site(r)) is not None:
            at.setdefault(f, []).append(r)
    if len(at) > 1:  # the others at several lines (a 2-D mesh: each held on its own group)
        missed = "; ".join(f"{who(rs)} at {at_line(f)}" for f, rs in at.items())
    me, others = who(s.culprits), who(s.waiting())
    head = (f"{me.capitalize()} left the loop at {loop_at(loop)} while {others} "
            f"{agree(s.waiting(), 'is', 'are')} still in it ({missed})")
    exits = ways_out(s, loop)
    if (one := decided_exit(exits)) is not None:
        src = f"src={s.culprits[0]}" if len(s.culprits) == 1 else "src=DECIDING_RANK"
        return Advice(
            f"Only {me} {agree(s.culprits, 'takes', 'take')} the one early way out of the "
            f"loop at {loop_at(loop)}: the `{one.kind}` at {short_path(loop.file)}:{one.line} "
            f"under `if {one.decided_by}:` ({short_path(loop.file)}:{one.condition_line}). "
            f"{me.capitalize()} left the loop while {others} "
            f"{agree(s.waiting(), 'is', 'are')} still in it ({missed}): the decision to leave "
            f"was made on {me} alone. Make it on every rank: send it to all (a stop flag, "
            f"dist.broadcast) and {one.kind} on every rank.",
            f"stop = torch.tensor([float(should_stop)])  # set on the rank that decides\n"
            f"dist.broadcast(stop, {src})  # every rank gets the decision\n"
            f"if stop.item():\n    {one.kind}",
            site=Frame(loop.file, one.line, loop.function), site_why="the loop's way out")
    said = "; ".join(f"`{e.kind}` ({short_path(loop.file)}:{e.line})"
                     + (f" under `if {test}:`" if (test := _test(s, loop, e.line)) else "")
                     for e in exits)
    ways = (f" The source shows {'its one way' if len(exits) == 1 else 'its ways'} out "
            f"before its end: {said}.") if exits else ""
    past = ways_past(s, loop)
    if past:
        ways += (f" The source shows {'one way' if len(past) == 1 else 'ways'} past their "
                 "collective within a pass (a rank that takes it posts fewer): "
                 + "; ".join(f"{gate_code(g)} ({short_path(f.file)}:{g.line})"
                             for f, g in past) + ".")
    # the fix's line: the one way past (out of the loop, or by their collective in a pass)
    one_way = [Frame(loop.file, e.line, loop.function) for e in exits] \
        + [Frame(f.file, g.line, f.function) for f, g in past]
    way = one_way[0] if len(one_way) == 1 else None
    hook = next((h for r in s.waiting() if (h := grad_hook(s.frames.get(r, [])))), None)
    if hook is not None and not exits:
        # posted from a gradient hook: a parameter with no gradient posts nothing that pass
        return Advice(f"{head}: theirs is posted by {hook.function}() "
                      f"({short_path(hook.file)}:{hook.line}) from inside backward, a gradient "
                      "hook, which never runs for a parameter that got no gradient (a layer "
                      "the rank's data skipped, an expert with no token): that pass posts "
                      "fewer. Give every parameter a gradient every step (call the layer on an "
                      "empty input, or add `0 * p.sum()` to the loss); where the ranks ran "
                      "different numbers of iterations, give each the same count (all-reduce "
                      "it with MIN first).")
    # the majority names who deviated, not how: where the others each posted one more,
    # paired silently (gloo pairs equal sizes), they are the ones still in the loop
    extra = (f", or {others} each posted one more that paired silently with "
             f"{agree(s.culprits, 'one of its', 'one of theirs')} (the stacks do not tell "
             "which)") \
        * (s.basis == CulpritBasis.MAJORITY)
    if (through := as_many_passes(s, loop)) is not None:
        # its counts say it made the others' pass: what it lacks was skipped inside one
        group = pg_label(s.div.pg, s.div.pg_desc)
        site = branch_call(s.src, through) if s.div.pg_desc == "default_pg" else None
        named = f" The one under a branch in this loop on {group}: {at_line(site)}." \
            * bool(site)
        return Advice(
            f"{me.capitalize()} {agree(s.culprits, 'is', 'are')} past the loop at "
            f"{loop_at(loop)} while {others} {agree(s.waiting(), 'is', 'are')} still in it "
            f"({missed}), after as many passes: every pass posts on another group at "
            f"{at_line(through)}, and {agree(s.culprits, 'its', 'their')} counts on every "
            f"other group {agree(s.culprits, 'it shares', 'they share')} with them equal "
            f"theirs. {me.capitalize()} posted fewer on {group} in those passes: one the "
            "others post, skipped in a pass (an `if`, `continue` or `break` on the rank's own "
            f"data){extra}.{ways} Post every collective of a pass on every rank.{named}",
            site=site, site_why=None if site is None else
            f"the only collective on {group} of the loop that a branch decides")
    return Advice(f"{head}: the ranks ran different numbers of iterations, or {me} cut one "
                  "short before its collectives (a `continue` or `break` on a rank's own "
                  f"data){extra}.{ways} Give each the same count: equal data shards "
                  "(DistributedSampler), or all-reduce the count with MIN first; decide a "
                  "way out alike on every rank (all-reduce its flag); skip an update, never "
                  "an iteration's collectives.",
                  site=way, site_why=None if way is None else "the loop's way out" if exits
                  else "the way past their collective")


def advise_passes(s: Situation) -> Advice | None:
    """The ranks at the divergence are at two lines of one loop, one of them reached only by
    tests every rank decides alike in a pass on the loop's counter (``if step % 4 == 0:``)
    and the other not behind that test: whatever the ranks' data, they are out of step —
    they ran different numbers of passes up to here, or number them differently (a loop
    begun at another step: a start read from each rank's own state). None where not so."""
    sites = {r: f for r in sorted(s.div.per_rank) if (f := s.site(r)) is not None}
    lines = sorted(set(sites.values()), key=lambda f: (f.file, f.line))
    if len(lines) != 2 or len(sites) != len(s.div.per_rank):
        return None
    for due, other in (lines, lines[::-1]):
        g = periodic_gate(s.src, due.file, due.line)
        body = loop_step(s.src, due.file, due.line, other.line)
        if g is None or body is None or g in gates(s.src, other.file, other.line) \
                or (due.file, due.function) != (other.file, other.function):
            continue
        there = [r for r, f in sites.items() if f == due]
        rest = [r for r in sites if r not in there]
        head = Frame(due.file, body.line, due.function)
        return Advice(
            f"The ranks are out of step in the loop at {loop_at(head)} "
            f"(`{body.header}`): give every rank the same start and number of passes "
            f"(decide them on one rank, broadcast them). {who(there).capitalize()} posted at "
            f"{at_line(due)} under `if {g.test}:` ({short_path(due.file)}:{g.line}), a test "
            f"on the loop's counter every rank decides alike in a pass; {who(rest)} posted "
            f"at {at_line(other)}, outside it: the ranks ran different numbers of passes up "
            "to here, or number them differently (a start read from a rank's own state: a "
            "checkpoint, a data position).",
            site=head, site_why="the loop whose passes differ")
    return None


def ways_past(s: Situation, loop: Frame) -> list[tuple[Frame, Gate]]:
    """The ways past the waiting ranks' collective within one pass of ``loop`` that the
    source shows, each with its frame: the gates of their line inside the loop's body (a
    guard that leaves the pass early, ``if not torch.isfinite(loss): continue``; an ``if``
    around it) and of the calls below it. A rank past the loop that took one in some pass
    posted fewer. Empty where the waiting ranks are at several lines, or a rank condition
    decides it (that advice says it)."""
    paths = {tuple(f for f in s.frames.get(r, []) if not is_library_frame(f))
             for r in s.waiting()}
    if len(paths) != 1:
        return []
    mine = list(paths.pop())  # innermost first
    at = next((d for d, f in enumerate(mine)
               if (f.file, f.function) == (loop.file, loop.function)), None)
    if at is None or any(rank_condition(s.src, f.file, f.line) is not None
                         for f in mine[:at + 1]):
        return []
    names = _loop_names(s, loop)
    out = [(mine[at], g) for g in gates(s.src, mine[at].file, mine[at].line)
           if g.line > loop.line]
    for f in mine[:at]:
        out += [(f, g) for g in gates(s.src, f.file, f.line)]
    # not the loop's own ways out (said as such), nor a raise (a rank past it is alive), nor
    # a test every rank decides alike in a pass (``if step % ACCUM:``: its counter, constants)
    return [(f, g) for f, g in out
            if g.how.removeprefix("except-") not in ("break", "return", "raise")
            and not alike_in_a_pass(g.test, names)]


def _loop_names(s: Situation, loop: Frame) -> set[str]:
    """The loop's own target names (``for step, batch in ...``: step, batch)."""
    lf = s.src.line(loop.file, loop.line)
    return set(loop_targets(next((st.header for st in lf.path if st.line == loop.line), None)
                        if lf else None))


def as_many_passes(s: Situation, loop: Frame) -> Frame | None:
    """The culprits, past ``loop`` while the others are still in it, made as many passes as
    they have: a line of the loop's body before the waiting ranks' line posts on another
    group than the divergence's every pass (:func:`~.source.every_pass`), and the culprits'
    count on every other group they share with the waiting ranks equals theirs — one pass
    fewer would have posted one fewer there — posted before their last collective on the
    divergence's group (not after the loop), and on one at least as many as the passes begun
    (the loop's counter; at least two where no stack shows it). Then what they lack on the
    divergence's group was skipped inside a pass, not a pass left out. That line; else None
    (the counts differ or are not all known, or no such line)."""
    here = {f for r in s.waiting() for f in s.frames.get(r, [])
            if (f.file, f.function) == (loop.file, loop.function)}
    if len(here) != 1 or not s.culprits:
        return None
    at = here.pop()
    lf = s.src.line(loop.file, at.line)
    body = next((st for st in lf.path if st.line == loop.line), None) if lf else None
    if body is None:
        return None
    # a call elsewhere, as the source tells it: without ``group=`` where the divergence's
    # group is not the default one, with one where it is
    elsewhere = s.div.pg_desc != "default_pg"
    through = next((Frame(loop.file, ln, loop.function) for ln in body.calls if ln < at.line
                    and (lf := s.src.line(loop.file, ln)) is not None
                    and lf.default_group is elsewhere
                    and every_pass(s.src, Frame(loop.file, ln, loop.function), at)), None)
    if through is None:
        return None
    # the passes begun, by the loop's counter; where no stack shows it, a group used once
    # (at start-up, a side group) says nothing of passes: at least two
    passes = _passes(s, body) or 2
    compared = 0
    for c in s.culprits:
        since = s.before_ns.get(c)
        for pg, n in s.enqueued.get(c, {}).items():
            if pg == s.div.pg:
                continue
            theirs = {s.enqueued[w][pg] for w in s.waiting() if pg in s.enqueued.get(w, {})}
            t = s.posted_ns.get(c, {}).get(pg)
            # another count, none to compare with, or posted after its last collective on
            # the divergence's group (after the loop, it may be): the counts say nothing
            if theirs != {n} or (since is not None and t is not None and t > since):
                return None
            # a group posted on at least once a pass, before the loop was left
            compared += n >= passes and since is not None and t is not None
    return through if compared else None


def _passes(s: Situation, body: Step) -> int | None:
    """The passes of the loop the waiting ranks have begun, by its counter on their stacks
    (``for step in ...``: ``step`` + 1, counted from 0), where they all agree."""
    names = loop_targets(body.header)
    seen = {s.counters.get(w, {}).get(names[0]) for w in s.waiting()} if len(names) == 1 \
        else {None}
    return None if len(seen) != 1 or None in seen else int(seen.pop() or 0) + 1


@dataclass(frozen=True)
class WayOut:
    """A way out of a loop before its end, as the source shows it."""

    line: int
    kind: str  # ``break`` / ``return``
    decided_by: str | None = None  # the rank condition only the culprits take there
    condition_line: int | None = None  # its line


def decided_exit(exits: list[WayOut]) -> WayOut | None:
    """The loop's one way out before its end, where it sits under a rank condition only the
    culprits take: their decision alone."""
    return exits[0] if len(exits) == 1 and exits[0].decided_by is not None else None


def ways_out(s: Situation, loop: Frame) -> list[WayOut]:
    """The loop's ways out before its end, as the source shows them (from a waiting rank's
    line in it)."""
    here = next((f for r in s.waiting() for f in s.frames.get(r, [])
                 if (f.file, f.function) == (loop.file, loop.function)), None)
    lf = s.src.line(loop.file, here.line) if here is not None else None
    step = next((st for st in lf.path if st.line == loop.line), None) if lf else None
    out: list[WayOut] = []
    for line in step.exits if step is not None else ():
        ex = s.src.line(loop.file, line)
        kind = ex.path[-1].kind.lower() if ex is not None and ex.path else "break"
        # a rank condition of the loop's own body (one around the loop, every rank in it
        # took too)
        inside = ex is not None and ex.rank_condition_line is not None and step is not None \
            and step.line < ex.rank_condition_line <= step.end
        cond = ex.rank_condition if ex is not None and inside else None
        if ex is not None and cond is not None and not excludes_ranks(cond) \
                and taken_only_by(cond, s.culprits, s.waiting()):
            out.append(WayOut(line, kind, cond.removeprefix("if "), ex.rank_condition_line))
        else:
            out.append(WayOut(line, kind))
    return out


def _test(s: Situation, loop: Frame, line: int) -> str | None:
    """The test of the innermost ``if`` a way out sits in, inside the loop."""
    ex = s.src.line(loop.file, line)
    g = next((g for g in ex.gates if g.how in ("if", "else") and g.line > loop.line),
             None) if ex else None
    return None if g is None else g.test if g.how == "if" else f"not ({g.test})"


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
