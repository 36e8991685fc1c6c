"""Rank numbers for a person: ``0-3, 8``, ``rank 3`` / ``ranks 0, 4, 12``. Pure."""

from __future__ import annotations


def runs(numbers: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs, first and last: ``0, 1, 2, 5`` -> ``(0, 2), (5, 5)``."""
    ns = sorted(set(numbers))
    out: list[tuple[int, int]] = []
    for n in ns:
        if out and n == out[-1][1] + 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def spans(numbers: list[int]) -> str:
    """``0, 1, 2, 3, 8`` -> ``0-3, 8``; a pair stays ``0, 1``."""
    parts = [f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1)))
             for a, b in runs(numbers)]
    return ", ".join(parts)


def who(numbers: list[int]) -> str:
    """``rank 3``, ``ranks 0, 4, 12``, ``ranks 0-7``."""
    return ("rank " if len(set(numbers)) == 1 else "ranks ") + spans(numbers)
