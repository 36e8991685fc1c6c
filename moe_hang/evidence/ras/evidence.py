"""What the tool holds of NCCL RAS for one diagnosis (:class:`RasEvidence`): the reports
(polls) oldest first, what they say together, and which global rank each communicator rank is
— pure (:func:`ras_evidence` builds it; files and live queries are read elsewhere).

One report says each rank's state and its launch counts at one moment; frozen or moving takes
two, a few seconds apart (:data:`MIN_INTERVAL_S` at least). With more, the last two are
compared. JSON reports are ordered by their timestamps (local time, to the second), text
reports (which carry none) in the order given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moe_hang.evidence.ras.compare import compare_reports, one_report
from moe_hang.evidence.ras.counts import LAUNCH_COUNTS_CAVEAT
from moe_hang.evidence.ras.findings import COUNT_KINDS, RasComparison, RasFinding
from moe_hang.evidence.ras.mapping import BY_PROCESS, BY_WORLD, infer_global_ranks
from moe_hang.evidence.ras.ranks import ProcessKey
from moe_hang.evidence.ras.records import RasReport
from moe_hang.evidence.vocab import spans, who

MIN_INTERVAL_S = 1.0  # polls closer than this (one timestamp second) tell nothing apart
_TIMESTAMP = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class RasPoll:
    report: RasReport
    source: str  # the file it was read from, or where it was asked ("RAS at localhost:28028")


@dataclass
class RasEvidence:
    polls: tuple[RasPoll, ...]  # oldest first (empty when a live query got no answer)
    comparison: RasComparison  # the last two polls compared, or the one poll's own findings
    compared: bool  # two polls far enough apart: frozen and moving are known
    interval_s: float | None  # between the two compared polls (None: not known)
    maps: dict[str, dict[int, int]] = field(default_factory=dict)  # comm key: rank -> global
    mapped_by: str = ""  # mapping.BY_PROCESS | mapping.BY_WORLD | "" (not mapped)
    notes: list[str] = field(default_factory=list)  # what the reader must know about them

    @property
    def latest(self) -> RasReport | None:
        return self.polls[-1].report if self.polls else None

    def global_rank(self, comm: str, rank: int) -> int | None:
        return self.maps.get(comm, {}).get(rank)

    def lines(self) -> list[str]:
        """The evidence lines of a diagnosis: what was read, how ranks were mapped, notes."""
        if not self.polls:
            return [f"NCCL RAS: {n}" for n in self.notes] or ["NCCL RAS: no report"]
        rep = self.polls[-1].report
        when = (f"{self.interval_s:.1f} s apart" if self.interval_s is not None
                else "interval not known")
        what = (f"{len(self.polls)} reports ({when}; frozen or moving told)" if self.compared
                else f"{len(self.polls)} report{'s' if len(self.polls) > 1 else ''} "
                "(one poll: frozen or moving not told)")
        out = [f"NCCL RAS {rep.nccl_version} ({rep.fmt}): {what}, "
               f"{len(rep.communicators)} communicator(s), from "
               + ", ".join(p.source for p in self.polls)]
        if self.mapped_by == BY_PROCESS:
            out.append("NCCL RAS: communicator ranks mapped to global ranks by host and pid")
        elif self.mapped_by == BY_WORLD:
            out.append("NCCL RAS: no process of the job known; global ranks from the "
                       "communicator that holds every process RAS reached (torch numbers a "
                       "group of every rank by global rank)")
        else:
            out.append("NCCL RAS: communicator ranks not mapped to global ranks (no process "
                       "the tool knows of the job has RAS's host and pid, and no communicator "
                       "holds every process RAS reached)")
        out += [f"NCCL RAS: {n}" for n in self.notes]
        if any(f.kind in COUNT_KINDS for f in self.comparison.findings):
            out.append(f"NCCL RAS: {LAUNCH_COUNTS_CAVEAT} (every count below)")
        out += [f"NCCL RAS: {_short(f)}" for f in self.comparison.findings]
        return out


def _short(f: RasFinding) -> str:
    """One finding on one line: ``frozen_mismatch: communicator 0x6f6f… (2 ranks), rank 1
    (global 3): AllGather launched 150, rank 0 151`` (its sentence is in the JSON)."""
    text = f"{f.kind.value}: communicator {f.comm_hash}" + (
        f" ({f.comm_size} ranks)" if f.comm_size else "")
    if f.ranks:
        g = [x for x in f.global_ranks if x is not None]
        text += f", {who(f.ranks)}" + (f" (global {spans(g)})" if g else "")
    elif f.n_ranks:
        text += f", {f.n_ranks} ranks"
    if f.op and f.count is not None:
        text += f": {f.op} launched {f.count}, {who(f.ahead_ranks) + ' ' if f.ahead_ranks else ''}"
        text += f"{'the others ' if not f.ahead_ranks else ''}{f.ahead}"
    elif f.detail:
        text += f": {f.detail}"
    return text


def _stamp(r: RasReport) -> float | None:
    try:
        return time.mktime(time.strptime(r.timestamp, _TIMESTAMP))
    except (ValueError, OverflowError):
        return None


def order_polls(polls: Sequence[RasPoll]) -> list[RasPoll]:
    """Oldest first: by timestamp when every report has one, else as given."""
    stamps = [_stamp(p.report) for p in polls]
    if all(s is not None for s in stamps):
        return [p for _, _, p in sorted(zip(stamps, range(len(polls)), polls, strict=True),
                                        key=lambda t: (t[0], t[1]))]
    return list(polls)


def differ(polls: Sequence[RasPoll]) -> str | None:
    """Why these reports are not polls of one job (None when they may be): another NCCL
    version, or no communicator in common."""
    if len(polls) < 2:
        return None
    first = polls[0]
    for p in polls[1:]:
        if p.report.nccl_version != first.report.nccl_version:
            return (f"{first.source} is NCCL {first.report.nccl_version}, {p.source} NCCL "
                    f"{p.report.nccl_version}: not the same job")
        if not {c.hash for c in p.report.communicators} & \
                {c.hash for c in first.report.communicators}:
            return f"{first.source} and {p.source} share no communicator: not the same job"
    return None


def ras_evidence(polls: Sequence[RasPoll], *, known: Mapping[ProcessKey, int] | None = None,
                 aliases: Mapping[str, str] | None = None, world_size: int | None = None,
                 interval_s: float | None = None, notes: Sequence[str] = ()) -> RasEvidence:
    """The reports as evidence. ``known``: (host, pid) -> global rank of the job's processes
    as the tool saw them; ``aliases``: RAS address -> host name, where measured;
    ``interval_s``: between the last two polls when the caller timed them (else their
    timestamps say, to the second)."""
    ordered = order_polls(polls)
    reports = [p.report for p in ordered]
    maps, how, _names = infer_global_ranks(reports, known or {}, aliases=aliases,
                                           world_size=world_size)
    out_notes = list(notes)
    for p in ordered:
        if p.report.repaired:
            out_notes.append(f"{p.source}: {p.report.repaired}")
    if not ordered:
        return RasEvidence((), RasComparison(None, (), ()), False, None, maps, how, out_notes)
    if len(ordered) >= 2:
        a, b = ordered[-2].report, ordered[-1].report
        gap = interval_s
        if gap is None and (sa := _stamp(a)) is not None and (sb := _stamp(b)) is not None:
            gap = sb - sa
        if gap is not None and gap < MIN_INTERVAL_S:
            out_notes.append(f"the last two reports are {gap:.1f} s apart (their timestamps "
                             "are to the second): frozen or moving cannot be told; take them "
                             "a few seconds apart")
        else:
            cmp = compare_reports(a, b, interval_s=gap, maps=maps)
            return RasEvidence(tuple(ordered), cmp, True, gap, maps, how, out_notes)
    else:
        out_notes.append("one report: frozen or moving cannot be told (a second one a few "
                         "seconds later would tell)")
    return RasEvidence(tuple(ordered), one_report(ordered[-1].report, maps=maps), False, None,
                       maps, how, out_notes)
