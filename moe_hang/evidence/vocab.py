"""The words every layer shares, as ``str`` enums: they compare equal to their JSON spelling
and serialise as it, so files and JSON read as they always did (pure, no imports).

:class:`RankState` is what a rank is doing — the same five words in a stack's view
(:class:`~moe_hang.evidence.stacks.StackView`), a node's summary (runtime/coord) and the
diagnosis (``ranks[].state``).
"""

from __future__ import annotations

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
