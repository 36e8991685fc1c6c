"""The words every layer shares (pure, stdlib only): states as ``str`` enums — they compare
equal to their JSON spelling and serialise as it, so files and JSON read as they always did —
and the one way rank lists and exit codes are written for a person.

:class:`RankState` is what a rank is doing — the same five words in a stack's view
(:class:`~moe_hang.evidence.stacks.StackView`), a node's summary (runtime/coord) and the
diagnosis (``ranks[].state``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from enum import Enum


class StrEnum(str, Enum):
    """A str whose f-string and str() are its value on every Python (3.11 changed format())."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RankState(StrEnum):
    IN_COLLECTIVE = "in_collective"
    COMPUTING = "computing"
    IDLE = "idle"
    EXITED = "exited"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, v: object) -> RankState:
        """A state read from a file; anything else is ``unknown``."""
        try:
            return cls(str(v))
        except ValueError:
            return cls.UNKNOWN


class JobState(StrEnum):
    """What the job was doing when its evidence was captured (``processes.json`` ``job``)."""

    RUNNING = "running"
    COMPLETED = "completed"  # the launcher exited 0
    FAILED = "failed"  # a rank or the launcher failed
    STALLED = "stalled"  # nothing moved for --stall s while a rank waited
    DESYNC = "desync"  # ranks pending at one seq with a different op, size or dtype
    TIMED_OUT = "timed_out"  # torch's own watchdog dumps (post-mortem)

    @classmethod
    def parse(cls, v: object, default: JobState | None = None) -> JobState:
        try:
            return cls(str(v))
        except ValueError:
            return default or cls.STALLED


# ------------------------------------------------------------------ numbers for a person
# The one way every layer writes rank lists and exit codes (a sentence of the analysis, the
# first screen, a notice of the watcher, an error line).


def runs(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive runs, first and last: ``0, 1, 2, 5`` -> ``(0, 2), (5, 5)``."""
    out: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def spans(numbers: Iterable[int]) -> str:
    """``0, 1, 2, 3, 8`` -> ``0-3, 8``; a pair stays ``0, 1``."""
    return ", ".join(f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1)))
                     for a, b in runs(numbers))


WHO_MAX = 40  # longer than this, a rank list in a sentence is said by its size


def who(numbers: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 4, 12``, ``ranks 0-7``; scattered thousands: ``300 ranks``
    (the JSON lists them all)."""
    ns = sorted(set(numbers))
    text = spans(ns)
    if len(ns) == 1:
        return f"rank {text}"
    return f"ranks {text}" if len(text) <= WHO_MAX else f"{len(ns)} ranks"


def exit_desc(code: int | None) -> str:
    """``killed by SIGKILL``, ``exited with code 1``, ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def agree(numbers: Iterable[int], one: str, many: str) -> str:
    """The word that agrees with a rank list: ``agree(rs, "waits", "wait")``."""
    return one if len(set(numbers)) == 1 else many
