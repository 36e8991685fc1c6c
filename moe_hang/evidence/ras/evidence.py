"""What the tool holds of NCCL RAS for one diagnosis (:class:`RasEvidence`): the reports
(polls) oldest first, and which global rank each communicator rank is — pure
(:func:`ras_evidence` builds it; files and live queries are read elsewhere; what the polls
say together is :mod:`moe_hang.analysis.ras`'s).

JSON reports are ordered by their timestamps (local time, to the second), text reports (which
carry none) in the order given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moe_hang.evidence.ras.mapping import infer_global_ranks
from moe_hang.evidence.ras.ranks import ProcessKey
from moe_hang.evidence.ras.records import RasReport

_TIMESTAMP = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class RasPoll:
    report: RasReport
    source: str  # the file it was read from, or where it was asked ("RAS at localhost:28028")


@dataclass
class RasEvidence:
    polls: tuple[RasPoll, ...]  # oldest first (empty when a live query got no answer)
    interval_s: float | None  # between the last two polls, as the caller timed them
    maps: dict[str, dict[int, int]] = field(default_factory=dict)  # comm key: rank -> global
    mapped_by: str = ""  # mapping.BY_PROCESS | mapping.BY_WORLD | "" (not mapped)
    notes: list[str] = field(default_factory=list)  # what the reader must know about them

    @property
    def latest(self) -> RasReport | None:
        return self.polls[-1].report if self.polls else None

    def global_rank(self, comm: str, rank: int) -> int | None:
        return self.maps.get(comm, {}).get(rank)


def stamp(r: RasReport) -> float | None:
    try:
        return time.mktime(time.strptime(r.timestamp, _TIMESTAMP))
    except (ValueError, OverflowError):
        return None


def order_polls(polls: Sequence[RasPoll]) -> list[RasPoll]:
    """Oldest first: by timestamp when every report has one, else as given."""
    stamps = [stamp(p.report) for p in polls]
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
    maps, how, _names = infer_global_ranks([p.report for p in ordered], known or {},
                                           aliases=aliases, world_size=world_size)
    out_notes = list(notes)
    for p in ordered:
        if p.report.repaired:
            out_notes.append(f"{p.source}: {p.report.repaired}")
    return RasEvidence(tuple(ordered), interval_s, maps, how, out_notes)
