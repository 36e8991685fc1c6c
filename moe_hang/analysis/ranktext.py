"""Rank numbers for a person: ``0-3, 8``, ``rank 3`` / ``ranks 0, 4, 12``. Pure."""

from __future__ import annotations


def spans(numbers: list[int]) -> str:
    """``0, 1, 2, 3, 8`` -> ``0-3, 8``; a pair stays ``0, 1``."""
    ns = sorted(set(numbers))
    parts: list[str] = []
    i = 0
    while i < len(ns):
        j = i
        while j + 1 < len(ns) and ns[j + 1] == ns[j] + 1:
            j += 1
        parts.append(f"{ns[i]}-{ns[j]}" if j - i >= 2 else ", ".join(map(str, ns[i:j + 1])))
        i = j + 1
    return ", ".join(parts)


def who(numbers: list[int]) -> str:
    """``rank 3``, ``ranks 0, 4, 12``, ``ranks 0-7``."""
    return ("rank " if len(set(numbers)) == 1 else "ranks ") + spans(numbers)
