"""One :class:`~moe_hang.analysis.diagnosis.RankReport` per rank: its state, the collective it
is in (or its side of the divergence), the user line, tokens and stack (pure)."""

from __future__ import annotations

from typing import Any

from moe_hang.analysis.diagnosis import Divergence, RankCollective, RankReport
from moe_hang.analysis.rankstate import posting_site, recorder_only, to_rc
from moe_hang.analysis.timeline import RankView
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.stacks import autograd_function, in_backward
from moe_hang.evidence.vocab import RankState, exit_desc


def tokens(ev: RankEvidence) -> dict[str, Any] | None:
    """The routing the worker logged before its last forward collective."""
    fwd = [r for r in ev.records if r.phase == "forward" and r.tokens]
    if not fwd:
        return None
    last = fwd[-1]
    out = dict(last.tokens or {})
    lengths = next((r.lengths for r in reversed(fwd) if r.lengths), None)
    if lengths is not None:
        out["gathered_lengths"] = lengths
    assumed = next((r.assumed_lengths for r in reversed(fwd) if r.assumed_lengths), None)
    if assumed is not None:
        # what DTensor.from_local(Shard(0)) believes every rank holds
        out["assumed_lengths"] = assumed
    if last.layer is not None:
        out["layer"] = last.layer
    if last.step is not None:
        out["step"] = last.step
    return out


NOTHING_PENDING = "no collective pending in its dump"


def report(v: RankView, div: Divergence | None) -> RankReport:
    ev = v.ev
    coll = v.current
    # a live rank whose stack is in a collective its recorder does not hold pending (a
    # send/recv gloo does not record) is there, past its side of the divergence
    here = v.state == RankState.IN_COLLECTIVE and v.stack.op is not None \
        and v.stack.callsite is not None and coll is None
    side = div.per_rank.get(ev.rank) if div is not None and not here else None
    if coll is None and side is not None and div is not None:
        # nothing pending (it died): show its side of the divergence
        pick = v.tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
        if pick is not None and v.state in (RankState.IN_COLLECTIVE, RankState.EXITED):
            coll = pick
    rc = to_rc(coll, v)
    if rc is None and side is not None:
        rc = side  # known from the stack only (coll is None here)
    if rc is None and v.state == RankState.IN_COLLECTIVE and v.stack.op:
        rc = RankCollective(op=v.stack.op, pg="?", seq=None, source="stack",
                            callsite=v.site if here else None)
    if v.state == RankState.EXITED and ev.error is not None and ev.error.frames:
        site = v.site  # the line it raised at: fresher than its last collective's
    else:
        site = posting_site(coll, v) or v.site
    coll_in_backward = coll is not None and bool(coll.frames) and in_backward(coll.frames)
    phase = coll.phase if coll is not None and coll.phase else None
    if phase is None and (v.stack.in_backward or coll_in_backward):
        phase = "backward"
    fn = coll.autograd_fn if coll is not None and coll.autograd_fn else v.stack.autograd_function
    if fn is None and coll is not None and coll_in_backward:
        fn = autograd_function(coll.frames)
    note = None
    if ev.error is not None:
        note = f"{ev.error.type}: {ev.error.message[:160]}"
    elif ev.stack_error:
        note = ev.stack_error
    elif ev.exit_code is not None and ev.exit_code != 0:
        note = exit_desc(ev.exit_code)
    elif v.state == RankState.IDLE and recorder_only(ev):
        note = NOTHING_PENDING
    return RankReport(
        rank=ev.rank, pid=ev.pid, host=ev.host, state=v.state, collective=rc,
        callsite=site, tokens=tokens(ev), exit_code=ev.exit_code,
        phase=phase, autograd_function=fn,
        stack=[f.short() for f in v.stack.frames[:40]], stack_source=ev.stack_source, note=note)
