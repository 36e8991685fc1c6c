"""Every source of evidence about a rank that died, reconciled into one position (docs/DESIGN.md
§8.2). Pure, detection only.

gloo aborts a rank from a C++ thread (SIGABRT) before anything can dump its recorder: what is
left of it is its last heartbeat (how many collectives of each group completed), the stack it
died with (faulthandler: the op and the user line), the abort's byte counts in the job log,
and its peers' recorders (what they posted at each seq). Its position is the one all of these
agree with: the peers' collective at seq ``completed + 1`` of a group, when that collective is
the op its stack died in, posted from the same line. That entry is added to its timeline
(``source="reconciled"``, its sizes from the byte counts where they say them), so the alignment
meets it where it was. A position that contradicts the rank's own count or stack is never
used; where nothing agrees, the disagreement is said (:class:`Disagreement`) and the verdict
is less certain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import SizeAbort
from moe_hang.evidence.stacks import Frame, callsite
from moe_hang.evidence.vocab import RankState


@dataclass(frozen=True)
class Disagreement:
    rank: int
    text: str  # what disagrees, for a person (the evidence list)


def _same_line(a: Frame | None, b: Frame | None) -> bool:
    return a is not None and b is not None and (a.file, a.line) == (b.file, b.line)


def _own_sizes(theirs: list[list[int]], abort: SizeAbort | None) -> list[list[int]]:
    """The aborted rank's own input sizes, from a peer's and gloo's byte counts: in an
    all-gather it expected ``expected`` bytes from each peer because that is what it held
    itself (every member holds the same shape, it assumed), and received ``received`` (other
    ops exchange chunks of the buffer: their byte counts say nothing of one rank's sizes)."""
    if abort is None or not abort.received or not abort.expected or len(theirs) != 1:
        return []
    (dims,) = theirs
    if not dims:
        return []
    rows = dims[0] * abort.expected / abort.received
    return [[int(rows), *dims[1:]]] if rows.is_integer() and rows > 0 else []


def reconcile(views: RankViews, abort: SizeAbort | None) -> list[Disagreement]:
    """Place each rank that died inside a collective at the collective all its evidence
    agrees on (mutating its view); returns what could not be reconciled."""
    out: list[Disagreement] = []
    for r, v in views.items():
        op, site = v.stack.op, v.stack.callsite
        if v.state != RankState.EXITED or not op or op == "unknown" or site is None:
            continue
        if v.current is not None and v.current.completed is False and v.current.op == op \
                and _same_line(
                callsite(v.current.frames) if v.current.frames else site, site):
            continue  # its own records already say where it was
        if v.ev.heartbeat is None or v.ev.heartbeat.pg_status is None:
            continue  # no count of its own to check a position against
        found: list[tuple[str, int, Collective]] = []
        seen: list[str] = []
        for pg, done in v.tl.completed.items():
            # its count is a lower bound (a beat may lag the rank's last steps): the first
            # collective from there on that its stack's op and line agree with
            last = max((s for pv in views.values() for s in pv.tl.by_pg.get(pg, {})),
                       default=done)
            for n in range(done + 1, last + 1):
                if n in v.tl.by_pg.get(pg, {}):
                    break  # its own records reach this far: they speak for themselves
                peer = next((c for q, pv in views.items() if q != r
                             and (c := pv.tl.by_pg.get(pg, {}).get(n)) is not None), None)
                if peer is None:
                    continue
                there = callsite(peer.frames) if peer.frames else None
                if peer.op == op and (there is None or _same_line(there, site)):
                    found.append((pg, n, peer))
                    break
                if len(seen) < 3:
                    seen.append(f"{peer.op} at seq {n} of group {pg}"
                                + (f" ({there.short()})" if there else ""))
        if len(found) == 1:
            pg, n, peer = found[0]
            mine = replace(peer, seq=n, frames=list(v.stack.frames), completed=False,
                           source="reconciled", record_id=None,
                           input_sizes=_own_sizes(peer.input_sizes, abort)
                           if v.ev.exit_code == -6 and op == "all_gather" else [],
                           output_sizes=[])
            v.tl.by_pg.setdefault(pg, {})[n] = mine
            v.tl.enqueued[pg] = max(v.tl.enqueued.get(pg, -1), n)
            v.tl.has_data = True
            v.current, v.site = mine, site
        elif seen and not found:
            out.append(Disagreement(r, f"rank {r} died in {op} at {site.short()}, but what "
                                       "its peers posted next after its last completed "
                                       f"collective is {'; '.join(seen[:3])}: its own count, "
                                       "its stack and its peers' records disagree"))
    return out
