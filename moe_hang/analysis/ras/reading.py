"""What the RAS polls of one diagnosis say together (:class:`RasReading`) — pure.

One report says each rank's state and its launch counts at one moment; frozen or moving takes
two, a few seconds apart (:data:`MIN_INTERVAL_S` at least). With more, the last two are
compared (:func:`~moe_hang.analysis.ras.compare.compare_reports`); with one, only its own
findings stand (:func:`~moe_hang.analysis.ras.compare.one_report`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_hang.analysis.ras.compare import compare_reports, one_report
from moe_hang.analysis.ras.counts import LAUNCH_COUNTS_CAVEAT
from moe_hang.analysis.ras.findings import COUNT_KINDS, RasComparison, RasFinding
from moe_hang.evidence.ras.evidence import RasEvidence, RasPoll, stamp
from moe_hang.evidence.ras.mapping import BY_PROCESS, BY_WORLD
from moe_hang.evidence.ras.records import RasReport
from moe_hang.evidence.vocab import spans, who

MIN_INTERVAL_S = 1.0  # polls closer than this (one timestamp second) tell nothing apart


@dataclass
class RasReading:
    ras: RasEvidence
    comparison: RasComparison  # the last two polls compared, or the one poll's own findings
    compared: bool  # two polls far enough apart: frozen and moving are known
    interval_s: float | None  # between the two compared polls (None: not known)
    notes: list[str] = field(default_factory=list)  # the evidence's, and why not compared

    @property
    def polls(self) -> tuple[RasPoll, ...]:
        return self.ras.polls

    @property
    def latest(self) -> RasReport | None:
        return self.ras.latest

    def global_rank(self, comm: str, rank: int) -> int | None:
        return self.ras.global_rank(comm, rank)

    def lines(self) -> list[str]:
        """The evidence lines of a diagnosis: what was read, how ranks were mapped, notes."""
        ras = self.ras
        if not ras.polls:
            return [f"NCCL RAS: {n}" for n in self.notes] or ["NCCL RAS: no report"]
        rep = ras.polls[-1].report
        when = (f"{self.interval_s:.1f} s apart" if self.interval_s is not None
                else "interval not known")
        what = (f"{len(ras.polls)} reports ({when}; frozen or moving told)" if self.compared
                else f"{len(ras.polls)} report{'s' if len(ras.polls) > 1 else ''} "
                "(one poll: frozen or moving not told)")
        out = [f"NCCL RAS {rep.nccl_version} ({rep.fmt}): {what}, "
               f"{len(rep.communicators)} communicator(s), from "
               + ", ".join(p.source for p in ras.polls)]
        if ras.mapped_by == BY_PROCESS:
            out.append("NCCL RAS: communicator ranks mapped to global ranks by host and pid")
        elif ras.mapped_by == BY_WORLD:
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


def read_ras(ras: RasEvidence) -> RasReading:
    """The polls together: the last two compared where they are far enough apart (the
    caller's timing, else their timestamps), else the latest one's own findings."""
    polls, notes = ras.polls, list(ras.notes)
    if not polls:
        return RasReading(ras, RasComparison(None, (), ()), False, None, notes)
    if len(polls) >= 2:
        a, b = polls[-2].report, polls[-1].report
        gap = ras.interval_s
        if gap is None and (sa := stamp(a)) is not None and (sb := stamp(b)) is not None:
            gap = sb - sa
        if gap is not None and gap < MIN_INTERVAL_S:
            notes.append(f"the last two reports are {gap:.1f} s apart (their timestamps "
                         "are to the second): frozen or moving cannot be told; take them "
                         "a few seconds apart")
        else:
            return RasReading(ras, compare_reports(a, b, interval_s=gap, maps=ras.maps),
                              True, gap, notes)
    else:
        notes.append("one report: frozen or moving cannot be told (a second one a few "
                     "seconds later would tell)")
    return RasReading(ras, one_report(polls[-1].report, maps=ras.maps), False, None, notes)


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


def ras_summary(reading: RasReading | None) -> dict[str, Any] | None:
    """``nccl_ras`` of the diagnosis JSON: the polls, whether they were compared, how ranks
    were mapped, and every finding (kind, communicator, ranks, global ranks, counts)."""
    if reading is None:
        return None
    ras, rep = reading.ras, reading.latest
    return {
        "polls": [p.source for p in ras.polls], "compared": reading.compared,
        "interval_s": reading.interval_s, "nccl_version": rep.nccl_version if rep else None,
        "mapped_by": ras.mapped_by or None, "notes": reading.notes,
        "findings": [{"kind": x.kind.value, "comm": x.comm_hash, "comm_size": x.comm_size,
                      "ranks": list(x.ranks), "global_ranks": list(x.global_ranks),
                      **({"op": x.op, "count": x.count, "ahead": x.ahead,
                          "ahead_ranks": list(x.ahead_ranks)} if x.op else {}),
                      "sentence": x.sentence} for x in reading.comparison.findings],
    }
