"""Every source of evidence about a rank that died, reconciled into one position (docs/DESIGN.md
§8.2). Pure, detection only.

gloo aborts a rank from a C++ thread (SIGABRT) before anything can dump its recorder: what is
left of it is its last heartbeat (how many collectives of each group completed), the stack it
died with (faulthandler: the op and the user line), the abort's byte counts in the job log,
and its peers' recorders (what they posted at each seq). Its position is the one all of these
agree with: the peers' collective at seq ``completed + 1`` of a group, when that collective is
the op its stack died in, posted from the same line. That entry is added to its timeline
(``source="reconciled"``, its sizes from the byte counts where they say them), so the alignment
meets it where it was. Its peers bound it too: every collective of a group needs every
member, so it was alive for each one they completed but the last (gloo may let the bigger
sender through), and died at the latest at the first one they could not complete — where a
stale count leaves the line's earlier steps as candidates, those are ruled out, and the same
op there from another line is the desync itself. A position that contradicts the rank's own
count or stack's op is never used; where nothing agrees, the disagreement is said
(:class:`Disagreement`) and the verdict is less certain.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from moe_hang.analysis.align import members
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import DEFAULT_PG, Collective
from moe_hang.evidence.model import RankEvidence, SizeAbort
from moe_hang.evidence.stacks import Frame, callsite
from moe_hang.evidence.vocab import RankState


@dataclass(frozen=True)
class Disagreement:
    rank: int
    text: str  # what disagrees, for a person (the evidence list)


def _same_line(a: Frame | None, b: Frame | None) -> bool:
    return a is not None and b is not None and (a.file, a.line) == (b.file, b.line)


def _own_sizes(theirs: list[list[int]], abort: SizeAbort | None) -> list[list[int]]:
    """The aborted rank's own input sizes, from its peers' and gloo's byte counts: it expected
    ``expected`` bytes of each message because that is what its own buffer makes (every
    member holds the same shape, it assumed — an all-gather's whole input, an all-reduce's
    chunk of it), and received ``received`` from a peer whose buffer was that much bigger."""
    if abort is None or not abort.received or not abort.expected or len(theirs) != 1:
        return []
    (dims,) = theirs
    if not dims:
        return []
    rows = dims[0] * abort.expected / abort.received
    return [[int(rows), *dims[1:]]] if rows.is_integer() and rows > 0 else []


def _then(counts: dict[str, int], later: list[tuple[str, int]],
          found: list[tuple[str, int, Collective]]) -> Iterator[tuple[str, int]]:
    """The counted groups, then — while nothing was ``found`` in them — ``later``."""
    yield from counts.items()
    if not found:
        yield from later


def _stale(ev: RankEvidence) -> bool:
    """Its records may end before it did: a recorder the probe saved a while before, with no
    posted log kept to its end (an abort's last gasp writes the log's end: every collective
    it posted is there)."""
    return ev.fr_saved and ev.log_end is None


def reconcile(views: RankViews, abort: SizeAbort | None) -> list[Disagreement]:
    """Place each rank that died inside a collective at the collective all its evidence
    agrees on (mutating its view); returns what could not be reconciled."""
    out: list[Disagreement] = []
    for r, v in views.items():
        op, site = v.stack.op, v.stack.callsite
        if v.state != RankState.EXITED or not op or op == "unknown" or site is None:
            continue
        # (unless they are a save older than its death: a collective pending then has
        # completed since, if its peers went past it)
        stale = _stale(v.ev)
        if v.current is not None and v.current.completed is False and v.current.op == op \
                and not stale and _same_line(
                callsite(v.current.frames) if v.current.frames else site, site):
            continue  # its own records already say where it was
        counts = dict(v.tl.completed)
        if not counts:
            # no count of its own (it died before a heartbeat saw a collective): it took part
            # in everything its peers completed, from the start; the default group is the
            # only one every rank surely belongs to
            counts = {DEFAULT_PG: -1}
        found: list[tuple[str, int, Collective]] = []
        seen: list[str] = []
        # a group its count does not name (its last beat came before its first collective
        # there): searched from the start, only where the counted groups place it nowhere
        uncounted = [(pg, -1) for pg, rs in members(views, None).items()
                     if r in rs and pg not in counts
                     and any(pg in pv.tl.by_pg for q, pv in views.items() if q != r)]
        for pg, done in _then(counts, uncounted, found):
            # its count is a lower bound (a beat may lag the rank's last steps): the first
            # collective from there on that its stack's op and line agree with. Its own
            # records speak for themselves — unless they are a save older than its death
            # (stale): then it went past the last one it saved, which it completed
            own = v.tl.by_pg.get(pg, {})
            if own and stale:
                done = max(done, max(own))
            last = max((s for pv in views.values() for s in pv.tl.by_pg.get(pg, {})),
                       default=done)
            # in a loop the same op and line come every step: the rank took part in every
            # collective its peers completed, so it died at the last candidate before the
            # first one a peer could not complete (gloo may let the bigger sender through)
            best: tuple[str, int, Collective] | None = None
            first_open: tuple[int, Collective] | None = None
            for n in range(done + 1, last + 1):
                if n in own:
                    break
                here = [c for q, pv in views.items() if q != r
                        and (c := pv.tl.by_pg.get(pg, {}).get(n)) is not None]
                if not here:
                    continue
                # any peer's entry its stack agrees with (the peers may disagree there: one
                # of them is the culprit, a step ahead of the others)
                like = [c for c in here if c.op == op and (
                    (t := callsite(c.frames) if c.frames else None) is None
                    or _same_line(t, site))]
                peer = like[0] if like else here[0]
                there = callsite(peer.frames) if peer.frames else None
                if like:
                    best = (pg, n, peer)
                elif best is None and len(seen) < 3:
                    seen.append(f"{peer.op} at seq {n} of group {pg}"
                                + (f" ({there.short()})" if there else ""))
                if any(c.completed is not True for c in here):
                    first_open = (n, peer)
                    break  # the first collective a peer did not complete: no further
            if first_open is not None:
                n, peer = first_open
                # every collective of a group needs every member: the peers' completing one
                # after seq n-1 (the one gloo may have let through) says it was alive then
                if best is not None and best[1] < n - 1:
                    best = None
                # still nothing: it died in the one its peers could not complete — the same
                # op from another line is the desync itself (a rank-0 evaluation's
                # all-gathers paired with the others' training ones until the shapes broke)
                if best is None and peer.op == op:
                    best = (pg, n, peer)
            if best is not None:
                found.append(best)
        if len(found) == 1:
            pg, n, peer = found[0]
            # its sizes: only where every peer posted one shape and dtype there (with three
            # ranks the bigger message came from one of them, and nothing says which; a
            # float64 message is twice a float32 one of the same shape)
            shapes = {(str(c.input_sizes), str(c.dtypes)) for q, pv in views.items() if q != r
                      and (c := pv.tl.by_pg.get(pg, {}).get(n)) is not None}
            # an all-gather sends its whole input; an all-reduce (ring) or reduce-scatter
            # sends chunks, whose byte counts say nothing of the rank's whole tensor
            one = len(shapes) == 1 and v.ev.exit_code == -6 and op == "all_gather"
            mine = replace(peer, seq=n, frames=list(v.stack.frames), completed=False,
                           source="reconciled", record_id=None,
                           input_sizes=_own_sizes(peer.input_sizes, abort) if one else [],
                           dtypes=list(peer.dtypes) if len(shapes) == 1 else [],
                           output_sizes=[])
            for c in v.tl.by_pg.get(pg, {}).values():  # it got past everything before it
                if c.seq < n:
                    c.completed = True
            v.tl.completed[pg] = max(v.tl.completed.get(pg, -1), n - 1)
            v.tl.by_pg.setdefault(pg, {})[n] = mine
            v.tl.enqueued[pg] = max(v.tl.enqueued.get(pg, -1), n)
            v.tl.has_data = True
            v.current, v.site = mine, site
        elif seen and not found and v.ev.stack_source != "probe":
            # (a stack from its last heartbeat is a sample up to a beat old, not where it
            # died: peers that went past it contradict nothing — a SIGKILL leaves no other)
            out.append(Disagreement(r, f"rank {r} died in {op} at {site.short()}, but what "
                                       "its peers posted next after its last completed "
                                       f"collective is {'; '.join(seen[:3])}: its own count, "
                                       "its stack and its peers' records disagree"))
    return out
