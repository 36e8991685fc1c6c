"""Align the ranks' collectives per process group by sequence number and find where they
first disagree, in every group; then pick the divergence that is the cause (docs/DESIGN.md
§8). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.diagnosis import DEFAULT_PG, Divergence, MismatchKind, RankState
from moe_hang.analysis.kinds import ROW, mismatch_kind
from moe_hang.analysis.order import who_skipped
from moe_hang.analysis.ranks import to_rc
from moe_hang.analysis.timeline import RankView, rank_view
from moe_hang.evidence.frtrace import Collective
from moe_hang.evidence.model import Heartbeat, RankEvidence
from moe_hang.evidence.stacks import in_backward


def members(views: dict[int, RankView], world: int | None) -> dict[str, list[int]]:
    """Each group's member ranks, from the probe's group list, the recorder's pg_config and
    who posted in it; the default group has every rank."""
    out: dict[str, set[int]] = {}
    for r, v in views.items():
        for pg, ranks in (v.ev.groups or {}).items():
            out.setdefault(pg, set()).update(ranks)
        if v.ev.fr is not None:
            for pg, ranks in v.ev.fr.pg_ranks.items():
                if pg in v.tl.by_pg:
                    out.setdefault(pg, set()).update(ranks)
        for pg in v.tl.by_pg:
            out.setdefault(pg, set()).add(r)
    all_ranks = set(range(world)) if world else set(views)
    out.setdefault(DEFAULT_PG, set()).update(all_ranks)
    return {pg: sorted(rs) for pg, rs in out.items()}


@dataclass
class Found:
    div: Divergence
    culprits: list[int]
    time_ns: int


def minority(groups: list[list[int]]) -> list[int] | None:
    """Majority vote over groups of ranks that agree: the ranks outside the largest group when
    it is strictly bigger than every other, else None (no majority: blame is undecided)."""
    ranked = sorted(groups, key=len, reverse=True)
    if len(ranked) > 1 and len(ranked[0]) > len(ranked[1]):
        return sorted(r for rs in ranked[1:] for r in rs)
    return None


def _blocked_elsewhere(v: RankView) -> bool:
    """Known not to be on its way to the missing collective: dead, or seen not moving. A
    single snapshot of a live rank proves nothing (it may be one step behind, computing)."""
    if v.state == RankState.EXITED:
        return True
    return v.state in (RankState.IDLE, RankState.IN_COLLECTIVE) and v.ev.progressed is False


def align(views: dict[int, RankView], world: int | None) -> Found | None:
    """The earliest sequence number, in any group, where member ranks disagree."""
    found: list[Found] = []
    for pg, ranks in members(views, world).items():
        f = _first_in_group(pg, ranks, views)
        if f is not None:
            found.append(f)
    if not found:
        return None
    # Two groups can each miss a rank (rank 3 skipped group 2's all-reduce and waits in the
    # barrier; rank 2 waits in that all-reduce and so never reaches the barrier). Blame the
    # divergence whose absent rank went *past* the collective, not the one stuck before it.
    return min(found, key=lambda f: (_is_consequence(f, views), f.time_ns, f.div.seq))


def _first_in_group(pg: str, ranks: list[int], views: dict[int, RankView]) -> Found | None:
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
        tag_culprits: list[int] | None = None
        if kind is None:
            tag_culprits = _skipped_by_tag(pg, seq, have, views)
            if tag_culprits is not None:
                kind = MismatchKind.MISSING
        if kind is None and absent:
            stuck = [r for r in absent if _blocked_elsewhere(views[r])]
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
        if tag_culprits is not None:
            culprits = tag_culprits
        elif kind == MismatchKind.MISSING:
            culprits = absent
        else:
            culprits = _culprits(kind, have, views)
        t = min((c.time_created_ns or 0) for c in have.values())
        return Found(div, sorted(culprits), t)
    return None


def _is_consequence(f: Found, views: dict[int, RankView]) -> bool:
    """A missing rank that is still *behind* the others in program order did not skip
    anything: it is held up earlier, by another group's divergence."""
    if f.div.kind != MismatchKind.MISSING or not f.culprits or f.div.seq is None:
        return False
    culprit = f.culprits[0]
    if f.div.per_rank.get(culprit) is not None:
        return False  # it posted this collective (a tag mismatch): it is not held up earlier
    present = [r for r, c in f.div.per_rank.items() if c is not None]
    if not present:
        return False
    r_wait = present[0]
    waiting = views[r_wait].tl.by_pg.get(f.div.pg, {}).get(f.div.seq)
    absent = views[culprit].current
    if waiting is None or absent is None:
        return False
    return who_skipped(waiting, absent, views, [r_wait], [culprit]) == "a"


def _skipped_by_tag(pg: str, seq: int, have: dict[int, Collective],
                    views: dict[int, RankView]) -> list[int] | None:
    """Same op and sizes, but the probe says they are different collectives (FSDP all-gathers
    of different experts have identical shapes and pair up silently). The rank that is
    *ahead* (its collective comes next on the others) skipped one: that is the culprit."""
    tags = {r: c.tag for r, c in have.items() if c.tag}
    if len(tags) < 2 or len(set(tags.values())) < 2:
        return None
    ahead = []
    for r, tag in tags.items():
        for q in tags:
            nxt = views[q].tl.by_pg.get(pg, {}).get(seq + 1)
            if q != r and nxt is not None and nxt.tag == tag and tags[q] != tag:
                ahead.append(r)
                break
    if ahead:
        return sorted(ahead)
    counts: dict[str, list[int]] = {}
    for r, tag in tags.items():
        counts.setdefault(tag, []).append(r)
    least = minority(list(counts.values()))
    return least if least is not None else sorted(tags)


def _culprits(kind: MismatchKind, have: dict[int, Collective],
              views: dict[int, RankView]) -> list[int]:
    """The minority at the divergence; with no majority, the side that went past the other's
    collective; else every rank there."""
    same = ROW[kind].same
    groups: list[tuple[Collective, list[int]]] = []
    for r, c in sorted(have.items()):
        for rep, rs in groups:
            if same(rep, c):
                rs.append(r)
                break
        else:
            groups.append((c, [r]))
    least = minority([rs for _, rs in groups])
    if least is not None:
        return least
    if kind == MismatchKind.OP and len(groups) == 2:  # two groups of equal size
        (a, ra), (b, rb) = groups
        ahead = who_skipped(a, b, views, ra, rb)
        if ahead is not None:
            return ra if ahead == "a" else rb
    return sorted(have)


def quick_divergence(heartbeats: dict[int, Heartbeat], world: int | None) -> Divergence | None:
    """From heartbeats alone: ranks pending at the same seq with a different op, size or
    dtype can never complete, so there is no need to wait for a stall timeout."""
    views = {r: rank_view(RankEvidence(rank=r, pid=hb.pid, heartbeat=hb, alive=True,
                                       progressed=False))
             for r, hb in heartbeats.items()}
    found = align(views, world)
    if found is None or found.div.kind == MismatchKind.MISSING:
        return None
    return found.div
