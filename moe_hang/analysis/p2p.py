"""Point-to-point calls the Flight Recorder saw (NCCL records every send and recv; gloo none):
a rank whose stream is held by a send or recv its peer never posted. Pure.

On NCCL a rank enqueues its collectives asynchronously, so after a skipped send every rank
may have enqueued the same collectives: no sequence number differs, and the only trace of
the fault is the receiver's pending recv with no send from its peer. The dumps then say who
waits (the receiver, its recv the oldest thing pending), for whom (the peer), and whether the
peer went past the point where the receiver posted it (the peer's later collectives in the
same group): then it skipped the send.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Divergence,
    MismatchKind,
    RankCollective,
    Verdict,
    pg_label,
)
from moe_hang.analysis.explain import site_str
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.source import rank_condition
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.evidence.flight_recorder import Collective, P2PEntry
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, callsite
from moe_hang.evidence.vocab import RankState, spans


def advise_p2p(waiter: int, op: str, peer: int, site: Frame | None,
               src: SourceFacts) -> Advice:
    """A send or recv whose other side the peer never posts: the peer of a recv posts a
    send, not another recv — under the same condition as the call that waits."""
    other, arg, back = ("send", "dst", "src") if op == "recv" else ("recv", "src", "dst")
    cond = rank_condition(src, site.file, site.line) if site is not None else None
    at = f" at {site.short()}" if site is not None else ""
    under = f" (it runs under `{cond}`)" if cond else ""
    return Advice(f"Rank {waiter}'s {op}({back}={peer}){at}{under} waits for a {other} rank "
                  f"{peer} never posts: post the matching {other}({arg}={waiter}) on rank "
                  f"{peer} under the same condition as the {op}, the same number of times — "
                  f"or remove the {op}.")


@dataclass(frozen=True)
class Unmatched:
    """``waiter`` is held by ``entry`` (a send/recv to/from ``peer``) that ``peer`` has not
    posted its side of."""

    waiter: int
    peer: int
    entry: P2PEntry
    last_with: P2PEntry | None  # the peer's last recorded op with the waiter, that group
    past: Collective | None  # the peer's first collective in that group after the point

    @property
    def skipped(self) -> bool:
        """The peer went past where the waiter posted the call without posting its side."""
        return self.past is not None

    def describe(self) -> str:
        other = "from" if self.entry.op == "recv" else "to"
        return f"{self.entry.op} {other} rank {self.peer}"


def _head(v: RankView) -> P2PEntry | None:
    """The rank's oldest pending send/recv, when nothing it posted earlier is still pending
    (it holds the rank's stream)."""
    fr = v.ev.fr
    if fr is None or v.state != RankState.IN_COLLECTIVE or v.ev.progressed is not False:
        return None
    pending = [p for p in fr.p2p if p.completed is False and p.peer is not None]
    if not pending:
        return None
    e = min(pending, key=lambda p: (p.record_id if p.record_id is not None else 1 << 62))
    if e.record_id is None:
        return None
    older = [c for c in fr.entries if c.completed is False and c.record_id is not None
             and c.record_id < e.record_id]
    return None if older else e


def _answers(e: P2PEntry, waiter: int, other: P2PEntry) -> bool:
    return ({e.op, other.op} == {"send", "recv"} and other.peer == waiter and other.pg == e.pg)


def unmatched(views: RankViews) -> list[Unmatched]:
    """Every rank held by a send/recv its peer's dump has no pending answer to."""
    out: list[Unmatched] = []
    for r, v in sorted(views.items()):
        e = _head(v)
        if e is None or e.peer is None or e.peer == r or e.peer not in views:
            continue
        pv = views[e.peer]
        pfr = pv.ev.fr
        if pfr is None or pv.state == RankState.EXITED:
            continue  # nothing to compare (a dead peer is another rule's)
        if any(p.completed is False and _answers(e, r, p) for p in pfr.p2p):
            continue  # posted, both pending: a transport problem, not a skipped call
        last = max((p for p in pfr.p2p if _answers(e, r, p)),
                   key=lambda p: p.record_id or -1, default=None)
        past = min((c for c in pfr.entries if c.pg == e.pg and c.seq > e.seq >= 0),
                   key=lambda c: c.seq, default=None)
        out.append(Unmatched(r, e.peer, e, last, past))
    return out


def roots(found: list[Unmatched]) -> list[Unmatched]:
    """The unmatched calls whose peer is not itself held by one (the end of a chain); none
    left: the calls wait on each other in a ring."""
    held = {u.waiter for u in found}
    return [u for u in found if u.peer not in held]


def unmatched_outcome(f: Facts) -> Conclusion:
    found = unmatched(f.views)
    ends = roots(found)
    if not ends:  # every waiter's peer waits too: receive-before-send on every side
        ranks = sorted({u.waiter for u in found})
        parts = "; ".join(f"rank {u.waiter} waits in {u.describe()}" for u in found)
        return Conclusion(Verdict.HANG, ranks, CulpritBasis.CYCLE, Certainty.LIKELY,
                          f"Deadlock: {parts}, and none of them posted the other side.",
                          Advice("Each rank waits to receive before it sends: order the calls so "
                                 "one side sends first, or post both with isend/irecv "
                                 "(dist.batch_isend_irecv) and wait on them."),
                          p2p_divergence(found[0], f))
    skipped = [u for u in ends if u.skipped]
    chosen = skipped or ends
    culprits = sorted({u.peer for u in chosen})
    u = chosen[0]
    e = u.entry
    group = pg_label(e.pg, e.pg_desc)
    at = callsite(e.frames)
    mine = f"rank {u.waiter}'s {e.op} {'from' if e.op == 'recv' else 'to'} it"
    where = f"p2p #{e.p2p_seq} on {group}" + (f", at {site_str(at)}" if at else "")
    their = "send" if e.op == "recv" else "recv"
    if skipped:
        past = u.past
        assert past is not None
        last = ""
        if u.last_with is not None:
            lat = callsite(u.last_with.frames)
            last = (f": its last {their} to rank {u.waiter} there was #{u.last_with.p2p_seq}"
                    + (f" (at {site_str(lat)})" if lat else "") + ", and it")
        else:
            last = ": it"
        pat = callsite(past.frames)
        summary = (f"Rank {spans(culprits)} never posted the {their} that {mine} waits for "
                   f"({where}, posted after collective #{e.seq}){last} went on to {past.op} "
                   f"{group}#{past.seq}" + (f" at {site_str(pat)}" if pat else "") + ".")
        text = advise_p2p(u.waiter, e.op, culprits[0], at, f.views.source).text
        return Conclusion(Verdict.HANG, culprits, CulpritBasis.PROGRAM_ORDER, Certainty.LIKELY,
                          summary, Advice(text), p2p_divergence(u, f))
    pv = f.views[u.peer]
    now = (f"it is in {pv.current.op} {pg_label(pv.current.pg, pv.current.pg_desc)}"
           f"#{pv.current.seq}" if pv.state == RankState.IN_COLLECTIVE and pv.current
           else "it has nothing pending")
    summary = (f"Rank {u.waiter} waits in {e.op} {'from' if e.op == 'recv' else 'to'} rank "
               f"{u.peer} ({where}); rank {u.peer} has not posted the {their} and has posted "
               f"nothing in {group} since ({now}).")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      summary,
                      Advice(f"Rank {u.peer}'s stack while the job hangs says where it is instead "
                             "of the {their}: `moe-hang diagnose` (or `py-spy dump --pid PID`)."
                             .replace("{their}", their)),
                      p2p_divergence(u, f))


def p2p_divergence(u: Unmatched, f: Facts) -> Divergence:
    """A send/recv only one side posted, as a divergence (seq: the group's p2p sequence)."""
    e = u.entry
    mine = RankCollective(op=e.op, pg=e.pg, seq=e.p2p_seq, input_sizes=e.input_sizes,
                          dtypes=e.dtypes, pg_desc=e.pg_desc, time_created_ns=e.time_created_ns,
                          callsite=callsite(e.frames))
    return Divergence(e.pg, e.p2p_seq, MismatchKind.MISSING, e.pg_desc,
                      sorted({u.waiter, u.peer}), {u.waiter: mine, u.peer: None}, phase="p2p")
