"""Loading sets of Flight Recorder dumps on every core: each worker process holds one parsed
file at a time and sends back only its window, the groups' rank lists once per chunk
(:mod:`.postmortem`). Not pure in one respect: large sets are loaded in worker processes
(bounded; the only module of the package that starts any)."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.flight_recorder import DEFAULT_CONTEXT, HISTORY_BUDGET, FRDump
from moe_hang.evidence.flight_recorder.find import DumpFile, DumpSet, Problem
from moe_hang.evidence.flight_recorder.parse_entry import RankLists
from moe_hang.evidence.stacks import Frame
from moe_hang.settings import Settings

POOL_MIN_FILES = 24  # below this (or POOL_MIN_BYTES) forking workers costs more than it saves
POOL_MIN_BYTES = 4_000_000


@dataclass
class LoadedSet:
    dumps: DumpSet
    fr: dict[int, FRDump] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def versions(self) -> set[str]:
        return {d.version for d in self.fr.values()}

    def backends(self) -> set[str]:
        return {d.backend for d in self.fr.values() if d.backend}


def _load_one(path: Path, context: int | None, lists: RankLists) -> FRDump | str:
    """A dump, or why the file is not one (one line)."""
    try:
        return fr.load(path, context=context, lists=lists)
    except fr.DumpError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except Exception as exc:  # a dump no release writes: report the file, keep the others
        return f"not a readable Flight Recorder dump ({type(exc).__name__}: {exc})"[:200]


@dataclass
class _Chunk:
    """What a worker sends back: dumps whose ``pg_ranks`` were replaced by digests into one
    table (each distinct rank list once), or the reason per file."""

    items: list[tuple[int, str, FRDump | str]]  # (rank, path, dump or reason)
    refs: dict[int, dict[str, str]]  # rank -> group -> digest
    table: dict[str, tuple[int, ...]]


@contextlib.contextmanager
def gc_paused(freeze: bool = True) -> Iterator[None]:
    """No cyclic GC while loading: parsing allocates millions of small acyclic objects, and
    each collection would walk them all again (torchfrtrace and the floor do the same); the
    verdict on them, the same (its views of 8192 ranks' dumps: 0.6 of 5.2 s were the
    collector's). ``freeze``: afterwards what was loaded is frozen out of the collector's
    generations, so later collections do not walk it either (it holds no cycles;
    refcounting still frees it); the verdict's own objects are garbage once it returns, and
    a freeze would pin any cycle among them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was:
            gc.enable()


def _load_chunk(args: tuple[list[tuple[int, str]], int | None]) -> _Chunk:
    files, context = args
    gc.disable()  # a worker process of ours: see gc_paused
    out = _Chunk([], {}, {})
    lists = RankLists()  # the chunk's files repeat the same groups: parsed once here
    for rank, path in files:
        got = _load_one(Path(path), context, lists)
        if isinstance(got, FRDump) and got.pg_ranks:
            refs = {}
            for pg, members in got.pg_ranks.items():
                key = lists.digest(members)
                out.table.setdefault(key, members)
                refs[pg] = key
            out.refs[rank] = refs
            got.pg_ranks = {}
        out.items.append((rank, path, got))
    return out


def _share(chunk: _Chunk, shared: RankLists) -> None:
    """A chunk's stacks (each distinct one once: the worker shared them) replaced by the
    equal ones of earlier chunks: the analysis compares every rank's stacks, by identity
    first, as it would had one process parsed them all."""
    by_id: dict[int, list[Frame]] = {}

    def one(v: list[Frame]) -> list[Frame]:
        hit = by_id.get(id(v))
        if hit is None:
            hit = by_id[id(v)] = shared.stack(v)
        return hit

    for _rank, _path, got in chunk.items:
        if isinstance(got, str):
            continue
        for c in got.entries:
            c.frames = one(c.frames)
        for p in got.p2p:
            p.frames = one(p.frames)


def _workers(n_files: int, n_bytes: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < 2 or n_files < POOL_MIN_FILES or n_bytes < POOL_MIN_BYTES:
        return 1
    return max(1, min(cores, n_files // 8, math.ceil(n_bytes / POOL_MIN_BYTES)))


BY_BUDGET = -1  # load_sets' context: as many as HISTORY_BUDGET allows each file


def load_sets(sets: list[DumpSet], *, context: int | None = BY_BUDGET,
              workers: int | None = None, settings: Settings = Settings()) -> list[LoadedSet]:
    """Parse every file of every set (in parallel when it pays); unreadable files become
    :class:`Problem` s of their set. ``context``: completed entries kept per group (None:
    all; by default the history budget shared by the files, never under DEFAULT_CONTEXT).
    Raises TimeoutError when the workers stall (no chunk in ``settings.fr_load_timeout_s``,
    plus ``fr_load_s_per_mb`` of its size)."""
    loaded = [LoadedSet(s) for s in sets]
    jobs = [(i, f) for i, s in enumerate(sets) for _r, f in sorted(s.files.items())]
    if context == BY_BUDGET:
        context = max(DEFAULT_CONTEXT, HISTORY_BUDGET // max(1, len(jobs)))
    n_bytes = sum(f.size for _i, f in jobs)
    n = workers if workers is not None else _workers(len(jobs), n_bytes)
    by_path = {str(f.path): i for i, f in jobs}

    interned: dict[str, tuple[int, ...]] = {}  # one list per distinct group, for every rank
    shared = RankLists()  # one list per distinct stack, for every rank

    def take(chunk: _Chunk) -> None:
        for rank, path, got in chunk.items:
            ls = loaded[by_path[path]]
            if isinstance(got, str):
                ls.problems.append(Problem(Path(path), got, rank))
                continue
            for pg, key in chunk.refs.get(rank, {}).items():
                got.pg_ranks[pg] = interned.setdefault(key, chunk.table[key])
            ls.fr[rank] = got
        _share(chunk, shared)

    with gc_paused():
        if n <= 1:
            lists = RankLists()
            for i, f in jobs:
                got = _load_one(f.path, context, lists)
                if isinstance(got, str):
                    loaded[i].problems.append(Problem(f.path, got, f.rank))
                else:
                    loaded[i].fr[f.rank] = got
        else:
            _load_parallel(jobs, n, n_bytes, context, take, settings)
    return loaded


def _load_parallel(jobs: list[tuple[int, DumpFile]], n: int, n_bytes: int,
                   context: int | None, take: Callable[[_Chunk], None],
                   settings: Settings) -> None:
    """``n`` forked workers parse chunks of files; the results are taken as they come, so
    the parent holds windows only, never a whole dump."""
    import multiprocessing as mp  # not on the path of small sets

    # chunks of about equal bytes, several per worker so a slow file does not idle the rest
    per = max(4, math.ceil(len(jobs) / (n * 6)))
    chunks = [[(f.rank, str(f.path)) for _i, f in jobs[k:k + per]]
              for k in range(0, len(jobs), per)]
    # a worker that returns no chunk in this long has stalled
    limit = (settings.fr_load_timeout_s
             + settings.fr_load_s_per_mb * (n_bytes / len(chunks)) / 1e6)
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
