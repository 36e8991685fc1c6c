"""torch's own Flight Recorder dumps, after the fact: find the files a PATH names, load a set
of them on every core, and turn it into post-mortem :class:`Evidence` (pure: no torch).

A PATH is a directory of dumps, a prefix (``/tmp/nccl_trace_rank_``,
``~/.cache/torch/comm_lib_trace_rank_``) or one file. torch names a dump prefix + *global*
rank (the dump itself stores no rank and no host); JSON dumps are our ``.json`` convention
(torch writes JSON to no file). Within a directory every prefix is its own set.

Loading streams rank by rank: each worker process holds one parsed file at a time and sends
back only its window (:func:`moe_hang.evidence.frtrace.parse_dump` with ``context``); the
48 KB world rank list every dump repeats at 8192 ranks crosses the pipe once per chunk and is
shared by every rank's record in the parent.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe_hang.evidence import frtrace
from moe_hang.evidence.frtrace import DEFAULT_CONTEXT, FRDump
from moe_hang.evidence.model import Evidence, RankEvidence

# prefix + rank [+ the extension a copy or our JSON convention adds]
_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
_SUFFIX = re.compile(r"^(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
NO_DUMP_NOTE = "no Flight Recorder dump for this rank"
POOL_MIN_FILES = 24  # below this (or POOL_MIN_BYTES) forking workers costs more than it saves
POOL_MIN_BYTES = 4_000_000
LOAD_TIMEOUT_S = 120.0  # per chunk of files, plus LOAD_S_PER_MB of its size
LOAD_S_PER_MB = 0.5


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


@dataclass
class LoadedSet:
    dumps: DumpSet
    fr: dict[int, FRDump] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def versions(self) -> set[str]:
        return {d.version for d in self.fr.values()}

    def backends(self) -> set[str]:
        return {d.backend for d in self.fr.values() if d.backend}


# ----------------------------------------------------------------------------- finding


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


# ----------------------------------------------------------------------------- loading


def _load_one(path: Path, context: int | None) -> FRDump | str:
    """A dump, or why the file is not one (one line)."""
    try:
        return frtrace.load(path, context=context)
    except frtrace.DumpError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except Exception as exc:  # a dump no release writes: report the file, keep the others
        return f"not a readable Flight Recorder dump ({type(exc).__name__}: {exc})"[:200]


_DIGESTS: dict[int, tuple[list[int], str]] = {}  # id(list) -> (the list, kept alive; digest)


def _digest(ranks: list[int]) -> str:
    import hashlib  # workers only

    hit = _DIGESTS.get(id(ranks))
    if hit is None or hit[0] is not ranks:
        hit = (ranks, hashlib.blake2b(array("q", ranks).tobytes(), digest_size=16).hexdigest())
        if len(_DIGESTS) > 8192:
            _DIGESTS.clear()
        _DIGESTS[id(ranks)] = hit
    return hit[1]


@dataclass
class _Chunk:
    """What a worker sends back: dumps whose ``pg_ranks`` were replaced by digests into one
    table (each distinct rank list once), or the reason per file."""

    items: list[tuple[int, str, FRDump | str]]  # (rank, path, dump or reason)
    refs: dict[int, dict[str, str]]  # rank -> group -> digest
    table: dict[str, list[int]]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC while loading: parsing allocates millions of small acyclic objects, and
    each collection would walk them all again (torchfrtrace and the floor do the same).
    Afterwards they are frozen out of the collector's generations, so the verdict's own
    collections do not walk them either (they hold no cycles; refcounting still frees
    them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def _load_chunk(args: tuple[list[tuple[int, str]], int | None]) -> _Chunk:
    files, context = args
    gc.disable()  # a worker process of ours: see _gc_paused
    out = _Chunk([], {}, {})
    for rank, path in files:
        got = _load_one(Path(path), context)
        if isinstance(got, FRDump) and got.pg_ranks:
            refs = {}
            for pg, members in got.pg_ranks.items():
                key = _digest(members)
                out.table.setdefault(key, members)
                refs[pg] = key
            out.refs[rank] = refs
            got.pg_ranks = {}
        out.items.append((rank, path, got))
    return out


def _workers(n_files: int, n_bytes: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < 2 or n_files < POOL_MIN_FILES or n_bytes < POOL_MIN_BYTES:
        return 1
    return max(1, min(cores, n_files // 8, math.ceil(n_bytes / POOL_MIN_BYTES)))


def load_sets(sets: list[DumpSet], *, context: int | None = DEFAULT_CONTEXT,
              workers: int | None = None) -> list[LoadedSet]:
    """Parse every file of every set (in parallel when it pays); unreadable files become
    :class:`Problem` s of their set. Raises TimeoutError when the workers stall."""
    loaded = [LoadedSet(s) for s in sets]
    jobs = [(i, f) for i, s in enumerate(sets) for _r, f in sorted(s.files.items())]
    n_bytes = sum(f.size for _i, f in jobs)
    n = workers if workers is not None else _workers(len(jobs), n_bytes)
    by_path = {str(f.path): i for i, f in jobs}

    interned: dict[str, list[int]] = {}  # one list per distinct group, shared by every rank

    def take(chunk: _Chunk) -> None:
        for rank, path, got in chunk.items:
            ls = loaded[by_path[path]]
            if isinstance(got, str):
                ls.problems.append(Problem(Path(path), got, rank))
                continue
            for pg, key in chunk.refs.get(rank, {}).items():
                got.pg_ranks[pg] = interned.setdefault(key, chunk.table[key])
            ls.fr[rank] = got

    with _gc_paused():
        if n <= 1:
            for i, f in jobs:
                got = _load_one(f.path, context)
                if isinstance(got, str):
                    loaded[i].problems.append(Problem(f.path, got, f.rank))
                else:
                    loaded[i].fr[f.rank] = got
        else:
            _load_parallel(jobs, n, n_bytes, context, take)
    return loaded


def _load_parallel(jobs: list[tuple[int, DumpFile]], n: int, n_bytes: int,
                   context: int | None, take: Callable[[_Chunk], None]) -> None:
    """``n`` forked workers parse chunks of files; the results are taken as they come, so
    the parent holds windows only, never a whole dump."""
    import multiprocessing as mp  # not on the path of small sets

    # chunks of about equal bytes, several per worker so a slow file does not idle the rest
    per = max(4, math.ceil(len(jobs) / (n * 6)))
    chunks = [[(f.rank, str(f.path)) for _i, f in jobs[k:k + per]]
              for k in range(0, len(jobs), per)]
    limit = LOAD_TIMEOUT_S + LOAD_S_PER_MB * (n_bytes / len(chunks)) / 1e6
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(n) as pool:  # __exit__ terminates the workers, also on Ctrl-C
        it = pool.imap_unordered(_load_chunk, [(c, context) for c in chunks])
        for _ in chunks:
            t0 = time.monotonic()
            try:
                take(it.next(timeout=limit))
            except mp.TimeoutError:
                raise TimeoutError(f"reading the dumps stalled ({time.monotonic() - t0:.0f} s "
                                   "without a result)") from None


# ----------------------------------------------------------------------------- evidence


def world_size(sets: list[LoadedSet]) -> int:
    """From every dump's groups (NCCL lists the whole default group), the highest rank in a
    group and the file numbering; each distinct rank list is looked at once."""
    w = 0
    seen: set[int] = set()
    for ls in sets:
        if ls.dumps.files:
            w = max(w, max(ls.dumps.files) + 1)
        for d in ls.fr.values():
            for members in d.pg_ranks.values():
                if id(members) in seen or not members:
                    continue
                seen.add(id(members))
                w = max(w, max(members) + 1, len(members))
    return w


def _set_line(ls: LoadedSet) -> str:
    vs = ", ".join(sorted(v or "?" for v in ls.versions())) or "?"
    bs = ", ".join(sorted(ls.backends())) or "?"
    line = (f"Flight Recorder dumps {ls.dumps.label}: {len(ls.fr)} read (format {vs}, {bs})")
    if len(ls.versions()) > 1:
        line += "; mixed format versions: files from different torch builds"
    return line


def evidence(sets: list[LoadedSet], *, world: int | None = None,
             extra: list[Problem] | None = None) -> Evidence:
    """Post-mortem evidence (the contract with the verdict engine): dumps written at a
    timeout mean every rank that dumped was stuck (alive, not progressing, no stack); a rank
    of the world with no dump is unknown, named as missing."""
    ranks: dict[int, RankEvidence] = {}
    lines: list[str] = []
    for ls in sets:
        lines.append(_set_line(ls))
        for r, d in sorted(ls.fr.items()):
            if r not in ranks:
                ranks[r] = RankEvidence(rank=r, fr=d, alive=True, progressed=False)
        for pb in ls.problems:
            if pb.rank is not None and pb.rank not in ranks:
                ranks[pb.rank] = RankEvidence(rank=pb.rank, alive=None,
                                              fr_error=f"{pb.path.name}: {pb.reason}")
            else:
                lines.append(pb.line())
    lines.extend(pb.line() for pb in extra or [])
    w = max(world or 0, world_size(sets))
    for r in range(w):
        if r not in ranks:
            ranks[r] = RankEvidence(rank=r, alive=None, notes=[NO_DUMP_NOTE])
    return Evidence(ranks=dict(sorted(ranks.items())), world_size=w or None, job="timed_out",
                    log_lines=lines, artifacts=", ".join(ls.dumps.label for ls in sets))


def group_ranks(ls: LoadedSet) -> dict[str, list[int]]:
    """Every group's members as this set's dumps list them (one list per distinct group)."""
    out: dict[str, list[int]] = {}
    for d in ls.fr.values():
        for pg, members in d.pg_ranks.items():
            out.setdefault(pg, members)
    return out


def conflicting_groups(ls: LoadedSet) -> list[str]:
    """Groups whose member list differs between two dumps of one set."""
    first: dict[str, list[int]] = {}
    bad: list[str] = []
    for d in ls.fr.values():
        for pg, members in d.pg_ranks.items():
            old = first.setdefault(pg, members)
            if old is not members and old != members and pg not in bad:
                bad.append(pg)
    return bad


def merge(captured: Evidence, dumped: Evidence) -> Evidence:
    """Captures (moe-hang run directories) and dumps of one job: a rank a capture holds keeps
    its capture (stacks, heartbeat, host, liveness) and gains the dump when it has no recorder
    data of its own; the others come from the dumps. The job state is the capture's."""
    ranks = dict(captured.ranks)
    for r, d in dumped.ranks.items():
        have = ranks.get(r)
        if have is None:
            ranks[r] = d
        elif have.fr is None and d.fr is not None:
            have.fr = d.fr
            if d.fr.source is not None:
                have.notes.append(f"Flight Recorder dump from {d.fr.source}")
            # what the capture did not measure, the dump's timeout says: stuck, not moving
            have.alive = d.alive if have.alive is None else have.alive
            have.progressed = d.progressed if have.progressed is None else have.progressed
    worlds = [w for w in (captured.world_size, dumped.world_size) if w]
    return Evidence(
        ranks=dict(sorted(ranks.items())), world_size=max(worlds) if worlds else None,
        job=captured.job, job_exit_code=captured.job_exit_code,
        agent_exit_code=captured.agent_exit_code, root_cause_rank=captured.root_cause_rank,
        log_lines=[*captured.log_lines, *dumped.log_lines],
        artifacts=", ".join(a for a in (captured.artifacts, dumped.artifacts) if a),
        size_abort=captured.size_abort)
