"""What a comparison of two RAS reports found (:class:`RasFinding`, :class:`RasComparison`)
and how findings name communicators and ranks — pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from moe_hang.evidence.ras.records import RasCommunicator
from moe_hang.evidence.vocab import spans, who


class FindingKind(str, Enum):
    # from the counts of two polls (their sentences carry counts.LAUNCH_COUNTS_CAVEAT)
    MOVING = "moving"  # some rank launched more collectives between the polls
    LAGGING = "lagging"  # these ranks launched nothing while others did, and are behind
    FROZEN_MISMATCH = "frozen_mismatch"  # nobody launched anything; these ranks are behind
    FROZEN_EQUAL = "frozen_equal"  # nobody launched anything; every rank at the same counts
    COUNT_RESET = "count_reset"  # counts went down: not comparable
    # from one report only: the counts disagree; frozen or moving takes a second report
    COUNTS_DIFFER = "counts_differ"
    # from the latest report's states
    DEAD = "dead"
    UNRESPONSIVE = "unresponsive"
    NOT_MEMBER = "not_member"  # answered, but not (or no longer) in the communicator
    RANK_ERROR = "rank_error"
    ABORTED = "aborted"
    FINALIZING = "finalizing"
    INITIALIZING = "initializing"
    # a communicator in one JSON report only
    APPEARED = "appeared"
    VANISHED = "vanished"


COUNT_KINDS = frozenset({FindingKind.MOVING, FindingKind.LAGGING, FindingKind.FROZEN_MISMATCH,
                         FindingKind.FROZEN_EQUAL, FindingKind.COUNT_RESET,
                         FindingKind.COUNTS_DIFFER})


@dataclass(frozen=True)
class RasFinding:
    """One fact about one communicator, with the sentence of evidence it supports."""

    kind: FindingKind
    comm: str  # RasCommunicator.key
    comm_hash: str
    comm_size: int
    ranks: tuple[int, ...]  # the communicator ranks it is about, ascending
    global_ranks: tuple[int | None, ...]  # the same ranks' global ranks (None: not mapped)
    sentence: str
    op: str | None = None  # the counted op (FROZEN_MISMATCH, LAGGING)
    count: int | None = None  # what the ranks behind launched (the lowest of them)
    ahead: int | None = None  # what the furthest rank launched
    ahead_ranks: tuple[int, ...] = ()
    n_ranks: int = 0  # ranks concerned, when the text report counts more than it names
    detail: str = ""  # the error, the state, the processes


@dataclass(frozen=True)
class RasCommProgress:
    """One communicator over the two polls: moving (some rank launched more), frozen (no
    rank did), or unknown (no counts to compare: the text report prints them only when they
    disagree; a communicator in one report only; counts that went down)."""

    comm: str
    comm_hash: str
    size: int
    progress: str  # "moving" | "frozen" | "unknown"
    compared: tuple[int, ...]  # ranks with counts in both polls
    moved: tuple[int, ...] = ()


@dataclass(frozen=True)
class RasComparison:
    interval_s: float | None  # between the two polls (None: not known)
    findings: tuple[RasFinding, ...]
    comms: tuple[RasCommProgress, ...]

    def of(self, *kinds: FindingKind) -> tuple[RasFinding, ...]:
        return tuple(f for f in self.findings if f.kind in kinds)

    @property
    def all_frozen(self) -> bool:
        """Every communicator with counts in both polls was frozen (and there was one)."""
        known = [c for c in self.comms if c.progress != "unknown"]
        return bool(known) and all(c.progress == "frozen" for c in known)


class Namer:
    """Communicators and ranks in findings' sentences, with global ranks where known."""

    def __init__(self, global_ranks: Mapping[str, Mapping[int, int]] | None) -> None:
        self.maps = global_ranks or {}

    def comm(self, c: RasCommunicator) -> str:
        size = f"{c.size} ranks" if c.size else "size not reported"
        label = f"{c.label} " if c.label else ""
        return f"communicator {label}{c.hash} ({size})"

    def globals_of(self, c: RasCommunicator, ranks: tuple[int, ...]) -> tuple[int | None, ...]:
        m = self.maps.get(c.key, {})
        return tuple(m.get(r) for r in ranks)

    def who(self, c: RasCommunicator, ranks: tuple[int, ...]) -> str:
        """``rank 1 (global rank 5)`` / ``ranks 0, 2-3 (global 0, 8-9)``."""
        g = [x for x in self.globals_of(c, ranks) if x is not None]
        text = who(ranks)
        if not g:
            return text
        unmapped = len(ranks) - len(g)
        tail = f"; {unmapped} not mapped" if unmapped else ""
        return f"{text} (global {'rank ' if len(ranks) == 1 else ''}{spans(g)}{tail})"

    def finding(self, kind: FindingKind, c: RasCommunicator, ranks: tuple[int, ...],
                sentence: str, *, op: str | None = None, count: int | None = None,
                ahead: int | None = None, ahead_ranks: tuple[int, ...] = (),
                n_ranks: int | None = None, detail: str = "") -> RasFinding:
        rs = tuple(sorted(set(ranks)))
        return RasFinding(kind=kind, comm=c.key, comm_hash=c.hash, comm_size=c.size, ranks=rs,
                          global_ranks=self.globals_of(c, rs), sentence=sentence, op=op,
                          count=count, ahead=ahead, ahead_ranks=tuple(sorted(ahead_ranks)),
                          n_ranks=len(rs) if n_ranks is None else n_ranks, detail=detail)
