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

from moe_hang.analysis.blocks import (
    EXTRA,
    Block,
    conditional_block,
    helper_block,
    part,
    user_code,
)
from moe_hang.analysis.blocks import identity as identity_of
from moe_hang.analysis.diagnosis import DEFAULT_PG, Divergence, MismatchKind
from moe_hang.analysis.mismatch import mismatch_kind
from moe_hang.analysis.program import signature
from moe_hang.analysis.rankstate import rank_view, to_rc
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import in_backward
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
class GroupDivergence:
    """Where one group's members first disagree."""

    div: Divergence
    have: dict[int, Collective]  # the members that posted this seq, with what they posted
    absent: list[int]  # members that never posted it, known to be blocked elsewhere or dead
    time_ns: int
    # the same op from different code, and nothing lines the ranks up again: where each is
    # stuck (its user code); filled for identity mismatches
    identity: dict[int, object] = field(default_factory=dict)
    # one side posted collectives the other did not: each way the diff reads (the ladder
    # chooses), and the one chosen (``block``, set with the blame)
    blocks: tuple[Block, ...] = ()
    block: Block | None = None


def blocked_elsewhere(v: RankView) -> bool:
    """Known not to be on its way to the missing collective: dead, or seen not moving. A
    single snapshot of a live rank proves nothing (it may be one step behind, computing)."""
    if v.state == RankState.EXITED:
        return True
    return v.state in (RankState.IDLE, RankState.IN_COLLECTIVE) and v.ev.progressed is False


def _plainly_agree(colls: list[Collective]) -> bool:
    """Every member posted it, alike in op, sizes, dtypes and the code that posted it (the
    same recorded stack, or none and not pending): nothing below could find a difference.
    Most seqs of most groups: the scan of 8192 ranks' dumps passes them here."""
    a = colls[0]
    # a probe's entry has no recorded stack (its code is its tag, or the rank's stack now)
    if a.tag or a.source == "probe" or (not a.frames and a.completed is False):
        return False
    return all(c.op == a.op and c.input_sizes == a.input_sizes and c.dtypes == a.dtypes
               and c.source == a.source and not c.tag and c.frames == a.frames
               and (a.frames or c.completed is not False) for c in colls[1:])


def _seen_in_order(pg: str, b: Block, views: RankViews) -> bool:
    """Each rank of the block's side posted, in an earlier step, the block's last
    collective right before what the other side posted after it."""
    if not b.items or b.lacking_next is None:
        return False
    pair = (signature(b.items[-1]), signature(b.lacking_next))
    for r in b.having:
        entries = views[r].tl.by_pg.get(pg, {})
        if not any((signature(c), signature(n)) == pair for s, c in entries.items()
                   if s < b.start and (n := entries.get(s + 1)) is not None and s + 1 < b.start):
            return False
    return True


def _first_in_group(pg: str, ranks: list[int], views: RankViews,
                    doubts: dict[str, int] | None = None) -> GroupDivergence | None:
    with_data = [r for r in ranks if r in views and views[r].tl.has_data]
    if len(with_data) < 2 and not any(views[r].tl.by_pg.get(pg) for r in with_data):
        return None
    tables = [(r, views[r].tl.by_pg.get(pg, {})) for r in with_data]
    nonempty = [t for _r, t in tables if t]
    if not nonempty:
        return None
    lo = max(min(t) for t in nonempty)  # older entries may have left a ring buffer
    hi = max(max(t) for t in nonempty)
    for seq in range(lo, hi + 1):
        present = {r: t.get(seq) for r, t in tables}
        have = {r: c for r, c in present.items() if c is not None}
        if not have or (len(have) == len(present) and _plainly_agree(list(have.values()))):
            continue
        absent = [r for r, c in present.items()
                  if c is None and views[r].tl.enqueued.get(pg, -1) < seq]
        kind = mismatch_kind(list(have.values()))
        identity: dict[int, object] = {}
        blocks: tuple[Block, ...] = ()
        camps: dict[object, list[int]] = {}
        for r, c in sorted(have.items()):
            camps.setdefault(identity_of(c, views[r]), []).append(r)
        codes = {r: user_code(c, views[r]) for r, c in have.items()}
        known = {code for code in codes.values() if code is not None}
        if len(have) >= 2 and (len({c.op for c in have.values()}) > 1 or len(known) > 1):
            # different ops, or the same op from different code: align what each posted from
            # here on (a block one side has and the other lacks), not their seq numbers
            got = part(pg, seq, list(camps.values()), views)
            if got.benign and kind is None:
                continue  # two code paths posting the same collectives: they line up again
            if got.blocks:
                blocks = got.blocks
                kind = MismatchKind.MISSING  # until the ladder reads it (settle)
            elif kind != MismatchKind.OP and all(c.completed is False for c in have.values()):
                # stuck in the same op from different code: different collectives
                kind = MismatchKind.MISSING
                identity = {r: code for r, code in codes.items() if code is not None}
            elif kind is None:
                # went through, and nothing says the two were not one step — nor that they
                # were: the steps the ranks agreed on end here
                if doubts is not None:
                    doubts.setdefault(pg, seq)
                continue
        elif kind == MismatchKind.SIZE and len(camps) == 2:
            # one collective with two sizes, or one side a collective out of step: it went
            # on (gloo lets the smaller message through) and posted next what the other
            # posted here, the two in the order its own earlier steps posted them
            got = part(pg, seq, list(camps.values()), views)
            if got.blocks and all(_seen_in_order(pg, b, views) for b in got.blocks):
                blocks, kind = got.blocks, MismatchKind.MISSING
        if kind is None and absent:
            stuck = [r for r in absent if blocked_elsewhere(views[r])]
            waiting = [r for r, c in have.items() if c.completed is not True]
            if stuck and waiting and len(stuck) == len(absent):
                kind = MismatchKind.MISSING
        if kind is None:
            continue
        if not blocks and (cb := conditional_block(pg, seq, with_data, views) or (
                helper_block(pg, seq, list(camps.values()), views))):
            blocks, kind, seq = (cb,), MismatchKind.EXTRA, cb.start
            present = {r: views[r].tl.by_pg.get(pg, {}).get(seq) for r in with_data}
            have = {r: c for r, c in present.items() if c is not None}
        first = next(iter(have.values()))
        per_rank = {r: to_rc(present.get(r), views[r]) for r in with_data}
        phase = next((c.phase for c in have.values() if c.phase), None)
        if phase is None and any(c.frames and in_backward(c.frames) for c in have.values()):
            phase = "backward"
        div = Divergence(pg=pg, seq=seq, kind=kind, pg_desc=first.pg_desc,
                         members=ranks, per_rank=per_rank, phase=phase)
        t = min((c.time_created_ns or 0) for c in have.values())
        return GroupDivergence(div, have, absent if not (identity or blocks) else [], t,
                               identity, blocks)
    return None


def settle(g: GroupDivergence) -> None:
    """Once the ladder chose how a block reads (``g.block``): the divergence's kind, and each
    side's entry — the block is what one side posted and the other never did."""
    block = g.block
    if block is None:
        return
    g.div.kind = MismatchKind.EXTRA if block.decided == EXTRA else MismatchKind.MISSING
    g.div.per_rank.update(dict.fromkeys(block.lacking))
    site = block.site
    for r in block.having:  # its own line: not the one every step goes through
        rc = g.div.per_rank.get(r)
        if rc is not None and site is not None:
            rc.callsite = site


def divergences(views: RankViews, world: int | None,
                doubts: dict[str, int] | None = None) -> list[GroupDivergence]:
    """Every group's first divergence, earliest first. ``doubts``: filled with each group's
    first seq where members posted one collective from different code that the diff could
    not explain either way (it completed; the agreed steps end there)."""
    found = [g for pg, ranks in members(views, world).items()
             if (g := _first_in_group(pg, ranks, views, doubts)) is not None]
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
