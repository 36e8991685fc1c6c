"""Finding torch's Flight Recorder dumps: the sets of files a PATH names (a directory, a prefix
or one file; :mod:`.postmortem` says how torch names them), and every PATH or
file that named nothing usable — pure."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# prefix + rank [+ the extension a copy or our JSON convention adds]
_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
_SUFFIX = re.compile(r"^(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")


@dataclass(frozen=True)
class DumpFile:
    path: Path
    rank: int
    size: int


@dataclass
class DumpSet:
    """The dumps of one prefix in one directory."""

    directory: Path
    prefix: str  # the file name before the rank ("comm_lib_trace_rank_")
    files: dict[int, DumpFile] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.directory / self.prefix}<rank>"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True)
class Problem:
    """A file (or PATH) that gave nothing, and why."""

    path: Path
    reason: str
    rank: int | None = None

    def line(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class Found:
    sets: list[DumpSet] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()  # a FIFO (torch's <prefix><rank>.pipe) is not: never opened
    except OSError:
        return False


def _scan(directory: Path) -> list[os.DirEntry[str]]:
    with os.scandir(directory) as it:
        return [e for e in it if not e.name.startswith(".")]


def _add(sets: dict[tuple[Path, str], DumpSet], found: Found, directory: Path, prefix: str,
         rank: int, path: Path, size: int) -> None:
    s = sets.setdefault((directory, prefix), DumpSet(directory, prefix))
    old = s.files.get(rank)
    if old is not None and old.path != path:
        # the same rank twice (pickle and JSON of one dump): the pickle has the frames
        keep, drop = (old, path) if old.path.suffix != ".json" else (DumpFile(path, rank, size),
                                                                     old.path)
        s.files[rank] = keep
        found.problems.append(Problem(drop, f"skipped: rank {rank} is also in {keep.path.name}",
                                      rank))
        return
    s.files[rank] = DumpFile(path, rank, size)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def find(paths: Iterable[Path]) -> Found:
    """The dump sets the PATHs name, and every PATH or file that named nothing usable."""
    found = Found()
    sets: dict[tuple[Path, str], DumpSet] = {}
    for given in paths:
        p = given.expanduser()
        if p.is_dir():
            _find_in_dir(p, sets, found)
        elif p.exists():
            named = _rank_of(p.name)
            if not p.is_file():
                found.problems.append(Problem(p, "not a regular file"))
            elif named is None:
                found.problems.append(Problem(p, "cannot tell the rank from the file name "
                                                 "(torch names a dump <prefix><rank>)"))
            else:
                _add(sets, found, p.parent, named[0], named[1], p, _size(p))
        elif p.parent.is_dir() and p.name:
            _find_prefix(p, sets, found)
        else:
            found.problems.append(Problem(p, "no such file or directory"))
    found.sets = [s for s in sets.values() if s.files]
    return found


def _rank_of(name: str) -> tuple[str, int] | None:
    """(prefix, rank) of a file named by torch (prefix + rank), or by a copy that kept the
    rank in its name (``rank3.fr.pkl``)."""
    m = _NAME.match(name)
    if m is not None:
        return m["prefix"], int(m["rank"])
    m = re.search(r"rank[_-]?(\d+)", name)
    return (name[:m.start(1)], int(m.group(1))) if m else None


def _find_in_dir(d: Path, sets: dict[tuple[Path, str], DumpSet], found: Found) -> None:
    try:
        entries = _scan(d)
    except OSError as exc:
        found.problems.append(Problem(d, f"cannot list it ({exc.strerror or exc})"))
        return
    others: list[str] = []
    n_sets = len(sets)
    n_files = sum(len(s.files) for s in sets.values())
    for e in entries:
        if not _is_regular(e):
            continue
        m = _NAME.match(e.name)
        if m is None:
            others.append(e.name)
            continue
        _add(sets, found, d, m["prefix"], int(m["rank"]), Path(e.path), _stat_size(e))
    if len(sets) == n_sets and sum(len(s.files) for s in sets.values()) == n_files:
        shown = ", ".join(sorted(others)[:5]) + (", …" if len(others) > 5 else "")
        found.problems.append(Problem(d, "not a moe-hang capture and no Flight Recorder dump "
                                         "in it (torch names a dump <prefix><rank>)"
                                      + (f"; its files: {shown}" if others else "; it is empty")))


def _stat_size(e: os.DirEntry[str]) -> int:
    try:
        return e.stat().st_size
    except OSError:
        return 0


def _find_prefix(p: Path, sets: dict[tuple[Path, str], DumpSet], found: Found) -> None:
    d, base = p.parent, p.name
    try:
        entries = _scan(d)
    except OSError as exc:
        found.problems.append(Problem(p, f"cannot list {d} ({exc.strerror or exc})"))
        return
    hits = 0
    for e in entries:
        if not e.name.startswith(base):
            continue
        m = _SUFFIX.match(e.name[len(base):])
        if m is not None and _is_regular(e):
            _add(sets, found, d, base, int(m["rank"]), Path(e.path), _stat_size(e))
            hits += 1
    if not hits:
        found.problems.append(Problem(p, f"no such file or directory, and no dump named "
                                         f"{base}<rank> in {d}"))
