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
