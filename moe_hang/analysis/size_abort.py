"""gloo's size-mismatch abort read from the job log: a divergence found without the
recorder's alignment, placed by the byte counts gloo printed (pure)."""

from __future__ import annotations

import signal

from moe_hang.analysis.diagnosis import Divergence, MismatchKind, RankCollective
from moe_hang.analysis.rankstate import to_rc
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.ops import nbytes
from moe_hang.evidence.stacks import Frame, callsite


def _paired_with(entries: list[Collective], site: Frame | None,
                 ratio: float | None) -> tuple[Collective, Collective] | None:
    """Which survivor entry the aborted rank's collective met, from gloo's byte counts: the
    aborted rank's collective is like the survivor's latest one from the same line (the
    survivor got past the divergence — it received less than it expected, which gloo lets
    through); the one it met is the survivor's entry that many times bigger."""
    if site is None or not ratio:
        return None
    same = [c for c in entries if (s := callsite(c.frames)) is not None
            and (s.file, s.line) == (site.file, site.line)]
    if not same:
        return None
    like = max(same, key=lambda c: c.seq)
    want = nbytes(like.input_sizes, like.dtypes)
    if not want:
        return None
    met = [c for c in entries if c.seq <= like.seq and (n := nbytes(c.input_sizes, c.dtypes))
           and abs(n / want - ratio) <= 0.01 * ratio]
    return (max(met, key=lambda c: c.seq), like) if met else None


def size_abort_divergence(views: RankViews,
                          ev: Evidence) -> tuple[Divergence, list[int]] | None:
    """gloo aborts the receiving rank when a peer sends more bytes than it expects ("Received
    data size doesn't match expected size"): a size mismatch, even where the aborted rank left
    no recorder dump. The survivors' entries name the group and sequence number; returns it
    with the aborted ranks."""
    abort = ev.size_abort
    if abort is None:
        return None
    aborted = [r for r, v in views.items()
               if v.ev.fatal or v.ev.exit_code == -signal.SIGABRT]
    if not aborted:
        return None
    ops = [views[r].stack.op for r in aborted if views[r].stack.op not in (None, "unknown")]
    op = ops[0] if ops else None
    ratio = abort.received / abort.expected if abort.received and abort.expected else None
    found: dict[int, Collective] = {}
    like: Collective | None = None
    for r, v in views.items():
        if r in aborted:
            continue
        same = [c for coll in v.tl.by_pg.values() for c in coll.values()
                if op is None or c.op == op]
        paired = _paired_with(same, views[aborted[0]].stack.callsite, ratio)
        if paired is not None:
            found[r], like = paired
        elif same:
            found[r] = max(same, key=lambda c: (c.time_created_ns or 0, c.seq))
    ref = next(iter(found.values()), None)
    pg = ref.pg if ref else "?"
    seq = ref.seq if ref else None
    per_rank: dict[int, RankCollective | None] = {r: to_rc(c, views[r])
                                                  for r, c in found.items()}
    for r in aborted:  # its sizes inferred from the abort, when the byte counts told them
        per_rank[r] = RankCollective(op=op or (ref.op if ref else "unknown"), pg=pg, seq=seq,
                                     input_sizes=like.input_sizes if like else [],
                                     dtypes=like.dtypes if like else [],
                                     source="inferred" if like else "stack",
                                     callsite=views[r].stack.callsite)
    sites = {(c.callsite.file, c.callsite.line) for c in per_rank.values()
             if c is not None and c.callsite is not None}
    # posted from different lines: not one collective with two sizes, one rank skipped one
    kind = MismatchKind.MISSING if len(sites) > 1 else MismatchKind.SIZE
    div = Divergence(pg=pg, seq=seq, kind=kind,
                     pg_desc=ref.pg_desc if ref else "", members=sorted(per_rank),
                     per_rank=per_rank, phase=ref.phase if ref else None)
    return div, aborted
