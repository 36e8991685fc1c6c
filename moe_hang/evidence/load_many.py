"""Several capture directories of one job (a multi-node watch's analysing node reads every
other node's) as evidence, on every core where that pays: at 128 nodes with full recorder
rings that is some 260,000 entries, seconds in one process. Each worker process loads whole
captures (:func:`moe_hang.evidence.load.load_capture`) and sends back their evidence. Not
pure in one respect: large loads start worker processes (bounded, as
:mod:`.flight_recorder.load_sets`)."""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path

from moe_hang.evidence.flight_recorder.load_sets import gc_paused
from moe_hang.evidence.flight_recorder.parse_entry import RankLists
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.vocab import JobState
from moe_hang.settings import Settings

POOL_MIN_CAPTURES = 8  # below this (or POOL_MIN_BYTES) forking workers costs more than it saves
POOL_MIN_BYTES = 16_000_000

Loaded = Evidence | str  # a capture's evidence, or why it is unreadable (one line)


def _load(root: Path, world: int | None, job: JobState | None, lists: RankLists) -> Loaded:
    try:
        return load_capture(root, world=world, job=job, lists=lists)
    except Exception as exc:  # another node's files are input: never the end of the round
        return type(exc).__name__


def _load_chunk(args: tuple[list[tuple[int, str]], int | None, JobState | None]
                ) -> list[tuple[int, Loaded]]:
    roots, world, job = args
    gc.disable()  # a worker process of ours: see gc_paused
    lists = RankLists()  # the chunk's captures repeat the same groups and stacks
    return [(i, _load(Path(root), world, job, lists)) for i, root in roots]


def _size(root: Path) -> int:
    total = 0
    for d in (root, root / "ranks", root / "stacks"):
        try:
            with os.scandir(d) as it:
                total += sum(e.stat().st_size for e in it if e.is_file(follow_symlinks=False))
        except OSError:
            continue
    return total


def _workers(n: int, n_bytes: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < 2 or n < POOL_MIN_CAPTURES or n_bytes < POOL_MIN_BYTES:
        return 1
    return max(1, min(cores, n // 2, math.ceil(n_bytes / (POOL_MIN_BYTES // 2))))


def load_captures(roots: list[Path], *, world: int | None = None, job: JobState | None = None,
                  workers: int | None = None, settings: Settings = Settings()) -> list[Loaded]:
    """Each capture's evidence (or why it is unreadable), in the order given. Raises
    TimeoutError when the workers stall (no chunk in ``settings.fr_load_timeout_s``, plus
    ``fr_load_s_per_mb`` of its size)."""
    sizes = [_size(r) for r in roots] if workers is None else []
    n = workers if workers is not None else _workers(len(roots), sum(sizes))
    with gc_paused(freeze=False):
        if n <= 1:
            lists = RankLists()  # every node's dumps name the same groups
            return [_load(r, world, job, lists) for r in roots]
        return _load_parallel(roots, n, world, job, settings)


def _load_parallel(roots: list[Path], n: int, world: int | None, job: JobState | None,
                   settings: Settings) -> list[Loaded]:
    import multiprocessing as mp  # not on the path of small loads

    per = max(1, math.ceil(len(roots) / (n * 3)))  # several chunks a worker: no idle tail
    items = [(i, str(r)) for i, r in enumerate(roots)]
    chunks = [items[k:k + per] for k in range(0, len(items), per)]
    n_bytes = sum(_size(r) for r in roots[:per])  # one chunk's, about
    limit = settings.fr_load_timeout_s + settings.fr_load_s_per_mb * n_bytes / 1e6
    out: list[Loaded] = ["not loaded"] * len(roots)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(n) as pool:  # __exit__ terminates the workers, also on Ctrl-C
        it = pool.imap_unordered(_load_chunk, [(c, world, job) for c in chunks])
        for _ in chunks:
            t0 = time.monotonic()
            try:
                for i, got in it.next(timeout=limit):
                    out[i] = got
            except mp.TimeoutError:
                raise TimeoutError(f"reading the nodes' captures stalled "
                                   f"({time.monotonic() - t0:.0f} s without a result)") from None
    return out
