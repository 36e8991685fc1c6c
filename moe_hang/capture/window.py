"""One sampling window over live ranks: a few py-spy samples a short interval apart, and each
rank's counters (context switches, read/write syscalls: :func:`moe_hang.runtime.procs.
read_counters`) and CPU time across them. ``moe-hang diagnose`` takes one; ``watch`` takes one
every few seconds when the probe is not running in the ranks. The same window, read the same
way, in both (docs/DESIGN.md §9)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from moe_hang.capture import pyspy
from moe_hang.capture.pyspy import StackResult
from moe_hang.capture.source import waits_on_collective
from moe_hang.evidence.activity import Activity
from moe_hang.evidence.stacks import (
    Frame,
    callsite,
    is_tool_frame,
    main_thread,
    parse_pyspy,
    view,
)
from moe_hang.evidence.vocab import RankState
from moe_hang.runtime.procs import (
    Counters,
    CpuClock,
    helpers_cores,
    helpers_cpu,
    main_thread_cpu,
    read_counters,
)
from moe_hang.settings import Settings

SAMPLES = 4  # a fast job's rank can sit in a collective in two samples; rarely in four
BUSY_CORES = 0.2  # a blocked rank's probe answering a dump uses ~0.01
MAIN_BUSY_CORES = 0.1  # of its main thread alone


def _sample(data: Any) -> tuple[tuple | None, bool, bool]:
    """(main-thread frames, on CPU, inside a collective) of one py-spy sample. Waiting on
    collectives posted earlier (``work.wait()``, ``torch.cuda.synchronize()``: how NCCL
    jobs wait, the call itself returning at once) is inside them."""
    try:
        t = main_thread(parse_pyspy(data))
    except (ValueError, TypeError, AttributeError):
        return None, False, False
    if t is None:
        return None, False, False
    frames = tuple((f.file, f.line, f.function) for f in t.frames)
    site = callsite(t.frames)
    inside = view(t).state == RankState.IN_COLLECTIVE or (
        site is not None and waits_on_collective(site.file, site.line))
    return frames, bool(t.active), inside


def progressed(a: Any, b: Any, cpu_cores: float | None = None) -> bool:
    """A rank moved between two samples: other frames, or on CPU both times (a long
    computation can sit on one line; a rank blocked in a collective is off CPU), or, outside
    any collective, its process kept cores busy over the interval (``cpu_cores``): a rank
    computing with OpenMP threads is often caught off CPU, its main thread in a futex waiting
    for its workers. Inside a collective CPU proves nothing (a spin-wait burns it too)."""
    (fa, on_a, coll_a), (fb, on_b, coll_b) = _sample(a), _sample(b)
    busy = cpu_cores is not None and cpu_cores > BUSY_CORES and not (coll_a or coll_b)
    return fa != fb or (on_a and on_b) or busy


def fingerprint(data: Any) -> tuple | None:
    """The main thread's frames of one sample (None: unreadable)."""
    return _sample(data)[0]


def in_collective(data: Any) -> bool:
    return _sample(data)[2]


def tool_threads(data: Any) -> set[int]:
    """OS thread ids of moe-hang's own threads in a py-spy sample (the probe, under watch):
    their I/O (heartbeats, dumps) is the tool's, not the rank's."""
    threads = data.get("threads", []) if isinstance(data, dict) else data
    out: set[int] = set()
    for t in threads if isinstance(threads, list) else []:
        if not isinstance(t, dict) or not isinstance(t.get("os_thread_id"), int):
            continue
        frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
        if any(is_tool_frame(Frame(str(f.get("filename", "")), 0, "")) for f in frames):
            out.add(int(t["os_thread_id"]))
    return out


def activity_between(a: Counters, b: Counters, *, attaches: int,
                     tool_tids: Iterable[int] = ()) -> Activity:
    """The window between two readings, the tool's own threads' I/O left out."""
    def diff(x: int | None, y: int | None) -> int | None:
        return None if x is None or y is None else max(0, y - x)

    syscalls, io_bytes = diff(a.syscalls, b.syscalls), diff(a.io_bytes, b.io_bytes)
    left_out = 0
    for tid in tool_tids:
        t0, t1 = a.threads_io.get(tid), b.threads_io.get(tid)
        if t0 is None or t1 is None:
            continue
        left_out += 1
        if syscalls is not None:
            syscalls = max(0, syscalls - max(0, t1[0] - t0[0]))
        if io_bytes is not None:
            io_bytes = max(0, io_bytes - max(0, t1[1] - t0[1]))
    return Activity(window_s=max(b.at - a.at, 1e-3), wakeups=diff(a.wakeups, b.wakeups),
                    preempted=diff(a.preempted, b.preempted), syscalls=syscalls,
                    io_bytes=io_bytes, attaches=attaches, tool_threads=left_out,
                    stopped=b.stopped, backends=tuple(sorted(set(a.backends) | set(b.backends))))


@dataclass
class RankWindow:
    samples: list[StackResult]  # every sample, readable or not
    final: StackResult  # the last readable one (else the last)
    moved: bool | None  # by its stacks and CPU; None: fewer than two readable samples
    activity: Activity | None  # its counters over the window; None: the process was gone
    main_busy: bool = False  # its main thread kept computing over the window
    # cores its own child processes (DataLoader workers, compile workers) kept busy
    helpers_cores: float = 0.0

    @property
    def seen(self) -> list[Any]:
        return [s.data for s in self.samples if s.data is not None]


def _cores(before: float | None, after: float | None, span_s: float) -> float | None:
    """Cores a process kept busy between two CPU-time readings (None: one is missing)."""
    return None if before is None or after is None else (after - before) / span_s


def sample_window(pids: dict[int, int], settings: Settings, *, native: bool = False,
                  samples: int = SAMPLES, locals_last: bool = True) -> dict[int, RankWindow]:
    """rank -> its window: ``samples`` py-spy samples ``settings.sample_interval_s`` apart
    (the last one with the peers of send/recv calls when ``locals_last``), counters and CPU
    across them. Bounded: every py-spy by ``settings.pyspy_timeout_s``."""
    clock = CpuClock()
    c0 = {r: read_counters(p) for r, p in pids.items()}
    cpu0, t0 = {r: clock.seconds(p) for r, p in pids.items()}, time.monotonic()
    main0 = {r: main_thread_cpu(p) for r, p in pids.items()}
    kids0 = {r: helpers_cpu(p) for r, p in pids.items()}
    taken: list[dict[int, StackResult]] = []
    for i in range(samples):
        if i:
            time.sleep(settings.sample_interval_s)
        taken.append(pyspy.pyspy_many(pids, timeout=settings.pyspy_timeout_s, native=native,
                                      with_locals=locals_last and i == samples - 1))
    c1 = {r: read_counters(p) for r, p in pids.items()}
    cpu1, t1 = {r: clock.seconds(p) for r, p in pids.items()}, time.monotonic()
    main1 = {r: main_thread_cpu(p) for r, p in pids.items()}
    kids1 = {r: helpers_cpu(p) for r, p in pids.items()}
    span = max(t1 - t0, 1e-3)
    out: dict[int, RankWindow] = {}
    for r in pids:
        mine = [s[r] for s in taken]
        final = next((s for s in reversed(mine) if s.data is not None), mine[-1])
        seen = [s.data for s in mine if s.data is not None]
        cores = _cores(cpu0[r], cpu1[r], span)
        # the main thread posts collectives and blocks in them (gloo: in a syscall, no CPU); one
        # that kept computing over the window completed collectives in between, however often
        # the samples found it inside one
        mc = _cores(main0[r], main1[r], span)
        busy = mc is not None and mc > MAIN_BUSY_CORES
        # outside every collective, a rank whose own helpers keep cores busy waits on its
        # own work (a DataLoader worker decoding a batch): moving, not stuck
        kids = helpers_cores(kids0[r], kids1[r], span)
        waits_on_helpers = kids > BUSY_CORES and not any(in_collective(d) for d in seen)
        moved = None
        if len(seen) >= 2:
            moved = busy or waits_on_helpers or any(
                progressed(a, b, cores) for a, b in itertools.pairwise(seen))
        a, b = c0[r], c1[r]
        tools = set().union(*(tool_threads(d) for d in seen)) if seen else set()
        act = (activity_between(a, b, attaches=len(mine),
                                tool_tids=tools)
               if a is not None and b is not None else None)
        out[r] = RankWindow(mine, final, moved, act, busy, kids)
    return out
