"""Align the ranks' collectives per process group by sequence number and find, in every
group, where the members first disagree (docs/DESIGN.md §8). Pure.

At one sequence number of a group the members may post different ops, or different sizes
(where every member must agree), or different dtypes; or the same op from different places in
the code (a rank skipped one and posted the next one early: FSDP's per-expert all-gathers have
identical shapes and pair up silently); or a member never posts it because it is blocked
elsewhere or dead. The first such seq is the group's divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_hang.analysis.diagnosis import DEFAULT_PG, Divergence, MismatchKind
from moe_hang.analysis.mismatch import mismatch_kind
from moe_hang.analysis.timeline import RankView, RankViews, rank_view, to_rc
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import Heartbeat, RankEvidence
from moe_hang.evidence.stacks import in_backward, is_library_frame
from moe_hang.evidence.vocab import RankState


def members(views: RankViews, world: int | None) -> dict[str, list[int]]:
    """Each group's member ranks, from the probe's group list, the recorder's pg_config and
    who posted in it; the default group has every rank."""
    out: dict[str, set[int]] = {}
    # torch's dumps list every group's members in every rank's dump: the loader shares one
    # list per distinct group, so each (group, list) is added once (8192 ranks: 8192 copies)
    seen: set[tuple[str, int]] = set()
    for r, v in views.items():
        for pg, ranks in (v.ev.groups or {}).items():
            out.setdefault(pg, set()).update(ranks)
        if v.ev.fr is not None:
            for pg, members in v.ev.fr.pg_ranks.items():
                if pg in v.tl.by_pg and (pg, id(members)) not in seen:
                    seen.add((pg, id(members)))
                    out.setdefault(pg, set()).update(members)
        for pg in v.tl.by_pg:
            out.setdefault(pg, set()).add(r)
    all_ranks = set(range(world)) if world else set(views)
    out.setdefault(DEFAULT_PG, set()).update(all_ranks)
    return {pg: sorted(rs) for pg, rs in out.items()}


@dataclass
class Shift:
    """From ``start`` on, the ``ahead`` ranks post what the ``behind`` ranks post ``k``
    collectives later: they skipped ``k`` of them. Identical collectives pair silently (FSDP's
    per-expert all-gathers have one shape), so the first visible difference (``first_diff``,
    one rank still in the expert loop, the other already in backward) comes after the skip;
    ``counts`` says how many collectives like the run's first each rank posted up to there."""

    ahead: list[int]
    behind: list[int]
    k: int
    start: int
    first_diff: int
    counts: dict[int, int]


@dataclass
class GroupDivergence:
    """Where one group's members first disagree."""

    div: Divergence
    have: dict[int, Collective]  # the members that posted this seq, with what they posted
    absent: list[int]  # members that never posted it, known to be blocked elsewhere or dead
    time_ns: int
    # the same op from different code: which ranks' entry is not the collective the others
    # posted here (they skipped one, or are behind); filled for identity mismatches
    identity: dict[int, object] = field(default_factory=dict)
    shift: Shift | None = None  # one side posts the other's collectives k seqs early


def blocked_elsewhere(v: RankView) -> bool:
    """Known not to be on its way to the missing collective: dead, or seen not moving. A
    single snapshot of a live rank proves nothing (it may be one step behind, computing)."""
    if v.state == RankState.EXITED:
        return True
    return v.state in (RankState.IDLE, RankState.IN_COLLECTIVE) and v.ev.progressed is False


def _identity(c: Collective, pending: bool, v: RankView) -> object | None:
    """What tells two same-op, same-size collectives apart: the probe's tag, else the user
    stack that posted it — the recorder's frames, or, for the collective a rank is blocked in,
    its stack now. None when nothing does."""
    if c.tag:
        return ("tag", c.tag)
    frames = c.frames if c.source != "probe" else []
    if not frames and pending and v.stack.frames and v.stack.op == c.op:
        frames = v.stack.frames
    user = tuple((f.file, f.line, f.function) for f in reversed(frames)
                 if not is_library_frame(f))
    return ("stack", user) if user else None


def _sig(pg: str, seq: int, r: int, views: RankViews) -> object | None:
    c = views[r].tl.by_pg.get(pg, {}).get(seq)
    if c is None:
        return None
    return (c.op, tuple(tuple(x) for x in c.input_sizes),
            _identity(c, c.completed is False, views[r]))


def _shift(seq: int, ids: dict[int, object], pg: str,
           views: RankViews) -> Shift | None:
    """Two camps whose posting stacks differ at ``seq``: is one of them ahead by k, the same
    collectives one position later on the other, at every seq from here on?"""
    camps: dict[object, list[int]] = {}
    for r, i in sorted(ids.items()):
        camps.setdefault(i, []).append(r)
    if len(camps) != 2:
        return None
    (ca, cb) = camps.values()
    last = max(max(views[r].tl.by_pg.get(pg, {}), default=seq) for r in (*ca, *cb))
    for k in (1, 2, 3):
        for ahead, behind in ((cb, ca), (ca, cb)):
            a, b = ahead[0], behind[0]
            matched = 0
            for u in range(seq, last + 1):
                x, y = _sig(pg, u, a, views), _sig(pg, u + k, b, views)
                if x is None or y is None:
                    continue
                if x != y:
                    break
                matched += 1
            else:
                if matched == 0:
                    continue
                start = seq
                while (x := _sig(pg, start - 1, a, views)) is not None and \
                        x == _sig(pg, start - 1 + k, b, views):
                    start -= 1
                loop = _sig(pg, start, b, views)
                counts = {r: sum(1 for u in range(start, seq + 1)
                                 if _sig(pg, u, r, views) == loop) for r in (*ahead, *behind)}
                return Shift(sorted(ahead), sorted(behind), k, start, seq, counts)
    return None


def _identities_differ(seq: int, have: dict[int, Collective], pg: str,
                       views: RankViews) -> tuple[dict[int, object], Shift | None]:
    """Same op and sizes, but not the same collective. At a seq that is still pending this is
    where the ranks are stuck; at one that completed (the pair went through, silently) it only
    counts if one side is shifted against the other from there on — two code paths may post
    the same collective legitimately (``if rank == 0: dist.barrier() else: dist.barrier()``),
    and then they line up again."""
    ids = {r: _identity(c, c.completed is False, views[r]) for r, c in have.items()}
    known = {r: i for r, i in ids.items() if i is not None}
    if len(known) < 2 or len(set(known.values())) < 2:
        return {}, None
    shift = _shift(seq, known, pg, views)
    if shift is not None or all(c.completed is False for c in have.values()):
        return known, shift
    return {}, None


def _first_in_group(pg: str, ranks: list[int], views: RankViews
                    ) -> GroupDivergence | None:
    with_data = [r for r in ranks if r in views and views[r].tl.has_data]
    if len(with_data) < 2 and not any(views[r].tl.by_pg.get(pg) for r in with_data):
        return None
    nonempty = [s for r in with_data if (s := set(views[r].tl.by_pg.get(pg, {})))]
    if not nonempty:
        return None
    lo = max(min(s) for s in nonempty)  # older entries may have left a ring buffer
    hi = max(max(s) for s in nonempty)
    for seq in range(lo, hi + 1):
        present = {r: views[r].tl.by_pg.get(pg, {}).get(seq) for r in with_data}
        have = {r: c for r, c in present.items() if c is not None}
        if not have:
            continue
        absent = [r for r, c in present.items()
                  if c is None and views[r].tl.enqueued.get(pg, -1) < seq]
        kind = mismatch_kind(list(have.values()))
        identity: dict[int, object] = {}
        shift: Shift | None = None
        if kind != MismatchKind.OP and len(have) >= 2:
            # same op from different code: different collectives, whose sizes or dtypes
            # differ because of that — a rank skipped one (stale all-to-all counts)
            ids, shift = _identities_differ(seq, have, pg, views)
            if ids:
                kind, identity = MismatchKind.MISSING, ids
            if shift is not None and shift.start < seq:  # show where the skip happened
                seq = shift.start
                present = {r: views[r].tl.by_pg.get(pg, {}).get(seq) for r in with_data}
                have = {r: c for r, c in present.items() if c is not None}
        if kind is None and absent:
            stuck = [r for r in absent if blocked_elsewhere(views[r])]
            waiting = [r for r, c in have.items() if c.completed is not True]
            if stuck and waiting and len(stuck) == len(absent):
                kind = MismatchKind.MISSING
        if kind is None:
            continue
        first = next(iter(have.values()))
        per_rank = {r: to_rc(present.get(r), views[r]) for r in with_data}
        phase = next((c.phase for c in have.values() if c.phase), None)
        if phase is None and any(c.frames and in_backward(c.frames) for c in have.values()):
            phase = "backward"
        div = Divergence(pg=pg, seq=seq, kind=kind, pg_desc=first.pg_desc,
                         members=ranks, per_rank=per_rank, phase=phase)
        t = min((c.time_created_ns or 0) for c in have.values())
        return GroupDivergence(div, have, absent if not identity else [], t, identity, shift)
    return None


def divergences(views: RankViews, world: int | None) -> list[GroupDivergence]:
    """Every group's first divergence, earliest first."""
    found = [g for pg, ranks in members(views, world).items()
             if (g := _first_in_group(pg, ranks, views)) is not None]
    return sorted(found, key=lambda g: (g.time_ns, g.div.seq or 0, g.div.pg))


def quick_divergence(heartbeats: dict[int, Heartbeat], world: int | None) -> Divergence | None:
    """From heartbeats alone: ranks pending at the same seq with a different op, size or
    dtype can never complete, so there is no need to wait for a stall timeout."""
    views = RankViews((r, rank_view(RankEvidence(rank=r, pid=hb.pid, heartbeat=hb, alive=True,
                                                  progressed=False)))
                      for r, hb in heartbeats.items())
    for g in divergences(views, world):
        if g.div.kind != MismatchKind.MISSING:
            return g.div
    return None
