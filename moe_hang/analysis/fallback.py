"""Divergences found without the recorder's alignment: ranks whose stacks wait in different
collectives (pure)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, MismatchKind, RankCollective
from moe_hang.analysis.gates import alike, ways_left_out
from moe_hang.analysis.ladder import (
    Context,
    Edit,
    Reading,
    decide,
    source,
)
from moe_hang.analysis.position import passes_from_peers, position_order, progress
from moe_hang.analysis.readings import camp_readings
from moe_hang.analysis.sides import every_rank_side, on_every_rank_all, sides
from moe_hang.analysis.source import (
    gates,
    module_group,
    on_default_group,
    on_every_rank,
    path_condition,
    periodic_gate,
)
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.stacks import Frame, idle_in_backward


def stack_divergence(ctx: Context, waiting: list[int], elsewhere: Sequence[int] = ()
                     ) -> tuple[Divergence, list[int], CulpritBasis] | None:
    """Without recorder data: ranks blocked in *different* collectives can never complete;
    nor can ranks blocked in the same op at different lines of the same code, where one line
    runs before the other (the ranks at the later line went past the earlier one without
    joining it: skipped it, or posted it on another group). ``elsewhere``: live ranks not
    waiting (computing, or seen moving) — any group collective may be waiting for them.
    Who deviated is the ladder's to say, from the stacks alone (no history: majority, the
    source's rank conditions, the order of the lines within one iteration)."""
    views = ctx.views
    ops: dict[int, str] = {r: op for r in waiting if (op := views[r].stack.op) is not None}
    if any(op != "unknown" for op in ops.values()):
        # a rank idle inside the autograd engine waits in what its backward's hooks posted
        # (DDP's buckets, FSDP's reduce-scatters: threads with no Python frames): a
        # collective, which one unknown — not outside every collective
        ops.update({r: "unknown" for r in waiting
                    if r not in ops and idle_in_backward(views[r].stack)})
    if all(op == "unknown" for op in ops.values()):
        return None  # waits on collectives posted earlier, and nothing says which
    # a rank that waits outside every collective (a lock, a queue) can hold up a group's
    # collective as much as one still computing
    elsewhere = [*elsewhere, *(r for r in waiting if r not in ops)]
    if len(set(ops.values())) > 1:
        # by op and line: one op at two lines is two collectives (a subgroup's all-reduce
        # and the world's after it), whoever else posts another op
        camps: dict[object, list[int]] = {}
        for r, op in sorted(ops.items()):
            cs = views[r].stack.callsite
            camps.setdefault((op, (cs.file, cs.line) if cs is not None else None),
                             []).append(r)
        kind = MismatchKind.OP
    else:
        camps = {}
        for r in sorted(ops):
            cs = views[r].stack.callsite
            camps.setdefault((cs.file, cs.line) if cs is not None else None, []).append(r)
        if len(camps) < 2 or None in camps:
            return None
        kind = MismatchKind.MISSING
    per_rank: dict[int, RankCollective | None] = {
        r: RankCollective(op=op, pg="?", seq=None, source="stack",
                          callsite=views[r].stack.callsite)
        for r, op in ops.items()}
    div = Divergence(pg="?", seq=None, kind=kind, members=sorted(ops), per_rank=per_rank,
                     phase="backward" if any(views[r].stack.in_backward for r in ops) else None)
    # a rank in a recv (or a send that blocks until its peer receives) whose peer is inside
    # a collective (py-spy --locals, or the probe, name the peer): the peer went on past the
    # send (the recv) it owed — no other rank owes a point-to-point op, so none of them is
    # a culprit of it; a rank waiting on a peer that is itself in a recv or a send is held
    # up by it (a pipeline stalls stage by stage)
    owed = {r: p2p.peer for r in ops if (p2p := views[r].stack.p2p) is not None
            and p2p.op in ("recv", "send") and p2p.peer is not None}
    peers = {q for q in owed.values() if q in ops and q not in owed}

    src = views.source
    merged_camps = sides(views, camps)
    merged, camps = len(merged_camps) < len(camps), merged_camps

    def at(r: int) -> tuple[Frame, ...]:
        return tuple(views[r].user_frames_outer_first())

    def where(k: object) -> tuple[Frame, ...]:
        return at(camps[k][0])

    # the ranks in a send or a recv a pass on from the one rank they wait on: its camp is a
    # collective behind them (they have each posted one that it has not)
    # (an extra of its camp: a divergence of kind EXTRA, at its line)
    if (lapped := _lapped_by_peers(views, camps, owed, where)):
        d = decide(lapped, ctx)
        if d.reading is None:
            return div, sorted({*lapped[0].culprits, *lapped[0].others}), d.basis
        return replace(div, kind=MismatchKind.EXTRA) if d.reading.edit == Edit.EXTRA \
            else div, d.culprits, d.basis

    # ... unless the lines say the rank in the recv is a lap on from its peer (it went round
    # the loop past the peer's collective: the peer never got back to the send)
    if owed and peers and all(q in peers or q in owed for q in owed.values()) and not any(
            position_order(src, at(r), at(q), progress(views, [r]), progress(views, [q]))
            for r, q in owed.items() if q in peers):
        return div, sorted(peers), CulpritBasis.PROGRAM_ORDER

    prog = {k: progress(views, rs) for k, rs in camps.items()}
    behind = [k for k in camps if all(position_order(src, where(k), where(o), prog[k], prog[o])
                                      is False for o in camps if o != k)]
    if elsewhere and not on_every_rank_all(
            views, camps, behind if kind == MismatchKind.MISSING else list(camps)):
        # a rank still computing can hold up every one of them: the ranks at the later line
        # completed the earlier collective on a group of their own (a 2-D mesh: the tp
        # all-reduce of the other tp group), and wait in the next one for the busy rank,
        # as the ranks at the earlier line do — a straggler
        return None
    # a camp the source puts on a group of its own may be at another position of another
    # group than the rest (ranks past their own group's collective, or a thread's group
    # the others' main threads are not in): counting ranks across groups says nothing
    # — unless the camp is a thread of the job's whose namesake on every other rank has
    # ended: those ranks will never post it, so it is one collective they all lack
    # (camps that all pass one group the module names once are on that one group)
    # (and camps whose groups each span every rank are counted as on one: every rank owes
    # each of them, so no rank can be past one of its own group's)
    # two sides, merged, whose conflict is on a collective every rank owes (one side's
    # every camp on one): every rank is counted on that group
    apart = not (merged and every_rank_side(views, camps)) \
        and not _one_named_group(views, camps) and any(
        on_every_rank(views.source, cs.file, cs.line) is False
        and not _thread_gone_elsewhere(views, rs, sorted(ops))
        for rs in camps.values() if (cs := views[rs[0]].stack.callsite) is not None)
    last = behind[0] if kind == MismatchKind.MISSING and len(behind) == 1 else None
    lap = _lap_readings(views, camps, last, where)
    extra = lap.extra
    ahead = extra[0].others if extra else ()  # the side that went past the lagging camp
    readings = []
    for x in camp_readings("?", None, list(camps.values()), {}, views) + extra:
        x = replace(x, given={**x.given, CulpritBasis.SOURCE: _branch_of_all(x, camps, ctx)})
        if apart and kind != MismatchKind.MISSING:  # (one op at two lines: below)
            x = replace(x, given={**x.given, CulpritBasis.MAJORITY: None})
        if kind == MismatchKind.MISSING:
            # one op at two lines: two branches may post the very same collective (they
            # pair), so only their order can say that one side went past the other's —
            # unless the source puts the branch's collective on a group no other camp's
            # is on (the default group against the others' subgroups): those never pair
            cond = x.given.get(CulpritBasis.SOURCE)
            side = x.culprits if cond is True else x.others
            keep = cond is not None and _unpaired(views, camps, side)
            given = {**x.given, CulpritBasis.SOURCE: cond if keep else None}
            if x.culprits not in lap.counted:
                given[CulpritBasis.MAJORITY] = None
            if lap.partners_unknown and x.culprits == ahead:
                given[CulpritBasis.PROGRAM_ORDER] = None
            if lap.left_out and x.culprits in (ahead, extra[0].culprits):
                given[CulpritBasis.SOURCE] = x.culprits == ahead
            x = replace(x, given=given)
        readings.append(x)
    d = decide(readings + _branch_split(views, camps, where), ctx)
    if d.basis == CulpritBasis.AMBIGUOUS:
        if kind == MismatchKind.MISSING:
            return None  # one op at two lines in no known order proves nothing
        return div, sorted(ops), CulpritBasis.AMBIGUOUS
    return div, d.culprits, d.basis


def _lapped_by_peers(views: RankViews, camps: dict[object, list[int]], owed: dict[int, int],
                     where: Callable[[object], tuple[Frame, ...]]) -> list[Reading]:
    """Every rank in a send or a recv a pass on (:func:`.position.passes_from_peers`) from
    the one rank they wait on, which waits in a collective every rank owes: they completed
    that collective in its pass and its camp has not — it posted one more before it, or
    they each one fewer (gloo pairs equal sizes silently, so the stacks read both ways
    alike). Read both ways and weighed by the count of ranks on each side; the other camps'
    places against these are not known, nor what was posted (no history, no rank condition
    on a collective the stacks do not show)."""
    passes = passes_from_peers(views, owed) if owed else None
    if passes is None or any(laps != 1 for _, laps in passes.values()):
        return []
    root = next(iter(passes.values()))[0]
    key = next((k for k, rs in camps.items() if root in rs), None)
    if key is None or not on_every_rank_all(views, camps, [key]):
        return []
    lagging, ahead = tuple(camps[key]), tuple(sorted(passes))
    at_lagging, at_ahead = where(key), tuple(views[ahead[0]].user_frames_outer_first())
    return [Reading(lagging, ahead, Edit.EXTRA, at_mine=at_lagging, at_theirs=at_ahead,
                    given=dict.fromkeys(_UNSAID)),
            Reading(ahead, lagging, Edit.SKIP, at_mine=at_ahead, at_theirs=at_lagging,
                    given=dict.fromkeys(_UNSAID))]


_UNSAID = (CulpritBasis.HISTORY, CulpritBasis.SOURCE, CulpritBasis.PROGRAM_ORDER)


@dataclass(frozen=True)
class _Lap:
    """What a lap between the camps allows: the two sides whose count weighs, whether the
    partners are unknown, the reading "the lagging camp posted an extra", and whether the
    source names the ranks ahead (the loop's only way to post fewer)."""

    counted: frozenset[tuple[int, ...]] = frozenset()
    partners_unknown: bool = False
    extra: list[Reading] = field(default_factory=list)
    left_out: bool = False


def _lap_readings(views: RankViews, camps: dict[object, list[int]], last: object | None,
                  where: Callable[[object], tuple[Frame, ...]]) -> _Lap:
    """One camp (``last``) behind every other on a collective every rank owes: the others
    went past it — they skipped it, or it is an extra of the camp's (gloo pairs equal sizes
    silently, so the stacks read both ways alike). The count of ranks on each side weighs,
    and nothing else can be counted across the camps.
    But where several ranks lag and the camps ahead wait on subgroups of theirs, the extra
    may be a few of the lagging ones (the ahead ranks' partners, whom the stacks do not
    name): then neither side is counted, nor does the lap alone say the ones ahead skipped
    it (the caller voids that reading's program order) — unless the source shows the only
    way the loop has to post one more or one fewer of those collectives: one a rank
    condition leaves the ranks ahead out of (then the source names them)."""
    if last is None or not on_every_rank_all(views, camps, [last]):
        return _Lap()
    lagging = tuple(camps[last])
    ahead = tuple(sorted(r for rs in camps.values() for r in rs if r not in lagging))
    partners_unknown = len(lagging) > 1 and not on_every_rank_all(
        views, camps, [k for k in camps if k != last])
    extra = Reading(lagging, ahead, Edit.EXTRA, at_mine=where(last),
                    at_theirs=tuple(views[ahead[0]].user_frames_outer_first()),
                    given={CulpritBasis.HISTORY: None, CulpritBasis.PROGRAM_ORDER: None})
    at = where(last)
    if partners_unknown and at and ways_left_out(views.source, at[-1], lagging, ahead):
        return _Lap(extra=[extra], left_out=True)
    if partners_unknown:
        return _Lap(partners_unknown=True, extra=[extra])
    return _Lap(frozenset({lagging, ahead}), extra=[extra])


def _branch_split(views: RankViews, camps: dict[object, list[int]],
                  where: Callable[[object], tuple[Frame, ...]]) -> list[Reading]:
    """Every camp inside one ``if`` by the same calls, some in its body and the rest in its
    ``else``: every rank ran that test and it went one way on some, the other way on the
    rest — a decision, counted over the ranks that made it (not ranks counted across
    groups). A test alike in a pass (``step % 4``) splits ranks in different passes, not a
    decision: no reading. One reading per side, weighed by the count alone (the stacks give
    no order between two branches, and the source's rank conditions are weighed on the
    camps' own readings)."""
    keys = list(camps)
    frames = [list(where(k)) for k in keys]
    src = views.source
    if len(keys) < 2 or not all(f and alike(f, frames[0]) for f in frames) or any(
            periodic_gate(src, f[-1].file, f[-1].line) is not None for f in frames):
        return []
    ways = [{(g.line, g.end): g.how for g in gates(src, f[-1].file, f[-1].line)
             if g.how in ("if", "else")} for f in frames]
    shared = [g for g in ways[0] if all(g in w for w in ways[1:])]
    if not shared:
        return []
    split = max(shared)  # the innermost ``if`` around them all
    side = {k: w[split] for k, w in zip(keys, ways, strict=True)}
    if len(set(side.values())) < 2:
        return []
    out = []
    for how in ("if", "else"):
        mine = [k for k in keys if side[k] == how]
        theirs = [k for k in keys if side[k] != how]
        culprits = tuple(sorted(r for k in mine for r in camps[k]))
        others = tuple(sorted(r for k in theirs for r in camps[k]))
        out.append(Reading(
            culprits, others, Edit.CHANGE, at_mine=where(mine[0]),
            at_mines=tuple(where(k) for k in mine), at_theirs=where(theirs[0]),
            given={CulpritBasis.HISTORY: None, CulpritBasis.SOURCE: None,
                   CulpritBasis.PROGRAM_ORDER: None,
                   CulpritBasis.MAJORITY: None if len(culprits) == len(others)
                   else len(culprits) < len(others)}))
    return out


def _group_key(views: RankViews, ranks: list[int]) -> str | None:
    """The group a camp's collective runs on, as far as the source says: ``default``, a
    name the module binds once, ``other`` (some ``group=``); None: not known."""
    cs = views[ranks[0]].stack.callsite
    if cs is None:
        return None
    default = on_default_group(views.source, cs.file, cs.line)
    if default is True:
        return "default"
    if (name := module_group(views.source, cs.file, cs.line)) is not None:
        return f"name:{name}"
    return "other" if default is False else None


def _unpaired(views: RankViews, camps: dict[object, list[int]], side: Sequence[int]) -> bool:
    """Every camp of ``side`` posts on a group no camp of the rest can be on (the default
    group against a ``group=``, or two names the module binds once): distinct process
    groups never pair, so their collectives are not one collective at two lines."""
    mine = [rs for rs in camps.values() if rs[0] in side]
    rest = [rs for rs in camps.values() if rs[0] not in side]

    def apart(a: str | None, b: str | None) -> bool:
        if a is None or b is None:
            return False
        if "default" in (a, b):
            return a != b
        return a.startswith("name:") and b.startswith("name:") and a != b

    return bool(mine and rest) and all(apart(_group_key(views, m), _group_key(views, o))
                                       for m in mine for o in rest)


def _one_named_group(views: RankViews, camps: dict[object, list[int]]) -> bool:
    """Every camp's collective passes the same group, one the module names once at its top
    level (``group=LOG`` on both lines): the ranks are counted on that one group."""
    sites = [views[rs[0]].stack.callsite for rs in camps.values()]
    names = {(cs.file, module_group(views.source, cs.file, cs.line)) if cs is not None
             else ("", None) for cs in sites}
    return len(names) == 1 and next(iter(names))[1] is not None


def _thread_gone_elsewhere(views: RankViews, camp: list[int], ranks: list[int]) -> bool:
    """The camp waits in a named thread of its own (a metrics thread) and no other rank has
    a thread of that name any more: theirs ended."""
    name = views[camp[0]].stack.thread
    if not name or any(views[r].stack.thread != name for r in camp):
        return False
    others = [r for r in ranks if r not in camp]
    return bool(others) and all(
        views[r].ev.threads and not any(t.name == name for t in views[r].ev.threads or [])
        for r in others)


def _branch_of_all(x: Reading, camps: dict[object, list[int]], ctx: Context) -> bool | None:
    """The source rung for one stack reading: a rank condition says who is missing only
    around a collective every rank owes — the members of a group of its own complete it
    together, so its branch says nothing of who is missing. The collective is the one the
    condition is on: the culprits' own (a branch only they take), or the others' (a branch
    that leaves the culprits out, ``if not (rank == r and step == 2)``)."""
    v = source(x, ctx)
    if v is None:
        return None
    views = ctx.views
    keys = [k for k, rs in camps.items()
            if path_condition(views.source, views[rs[0]].stack.frames) is not None]
    return v if on_every_rank_all(views, camps, keys) else None
