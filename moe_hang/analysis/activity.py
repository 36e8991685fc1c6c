"""Moving or stuck, from what a rank's process did over the sampling window (pure; the
counters: :class:`moe_hang.evidence.activity.Activity`; docs/DESIGN.md §9).

A rank caught inside the same collective in every stack sample is either in a collective that
never completes, or in a new one each time (a loop of small all-reduces). Where the transport
goes through syscalls (gloo; NCCL over sockets), each collective that completes wakes the main
thread waiting in it and moves bytes through read/write syscalls; a collective that never
completes does neither. Measured here (``python scripts/activity_table.py``, gloo, 2 CPU
cores, diagnose's own window: four py-spy samples 0.25 s apart), per second:

=====================================  ===============  ===============  =========
job                                    main wakeups/s   read+write /s    KB/s
=====================================  ===============  ===============  =========
healthy, all-reduce loop, 2 ranks      2004–3667        6127–11014       295–531
healthy, all-reduce loop, 8 ranks      250–300          744–1757         36–85
hung (skip, sleep, SIGSTOP), 2–8       5–10 (py-spy)    0                0
the probe's own thread, under watch    (not main)       4 (left out)     3
=====================================  ===============  ===============  =========

A hung rank's main thread is woken only by py-spy itself (each attach stops and resumes every
thread: measured up to 2.5 wakeups per attach), so :data:`WAKEUPS_PER_ATTACH` of them are
taken off before anything is read. The thresholds sit an order of magnitude from both sides:
moving needs at least :data:`MOVING_WAKEUPS_S` net wakeups and :data:`MOVING_SYSCALLS_S`
syscalls a second (the slowest healthy loop measured: ~230 and ~740); stuck needs at most
:data:`STUCK_WAKEUPS_S` net wakeups and :data:`STUCK_KB_S` of I/O a second (a hung rank: 0
and 0; the probe, whose own threads are left out, 3 KB/s if they were not). In between, or
with a counter unreadable, the counters cannot tell, and say so.

Transports without syscalls (NCCL over NVLink or InfiniBand: the GPU and the NIC move the
data) do not move these counters, and a CUDA rank waiting for a kernel spin-waits without
waking: on NCCL, counters never call a rank stuck, nor moving — the recorder, RAS launch
counts or ``moe-hang watch`` decide. A stopped process (SIGSTOP, job control) is stuck
whatever the transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.evidence.activity import Activity
from moe_hang.evidence.vocab import StrEnum

WAKEUPS_PER_ATTACH = 3  # py-spy: measured up to 2.5 per attach on a blocked main thread
MOVING_WAKEUPS_S = 20.0
MOVING_SYSCALLS_S = 20.0
STUCK_WAKEUPS_S = 2.0
STUCK_KB_S = 64.0
# backends whose transport the counters do not see
BLIND_BACKENDS = ("nccl", "xccl")


class Motion(StrEnum):
    MOVING = "moving"
    STUCK = "stuck"
    CANNOT_TELL = "cannot_tell"


@dataclass(frozen=True)
class Judgement:
    motion: Motion
    numbers: str  # what was read (:func:`numbers`)
    why: str  # what follows from them, in a few words


def numbers(a: Activity) -> str:
    """What was read, in words (what could not be read, said): ``4624 main-thread wakeups,
    13956 read/write syscalls, 672 KB in 1.24 s (4 py-spy attaches)``."""
    parts = [f"{a.wakeups} main-thread wakeups" if a.wakeups is not None
             else "main-thread wakeups unreadable"]
    if a.syscalls is None or a.io_bytes is None:
        parts.append("read/write syscalls unreadable")
    else:
        parts.append(f"{a.syscalls} read/write syscalls, {_kb(a.io_bytes)}")
    extra = f" ({a.attaches} py-spy attaches)" if a.attaches else ""
    return ", ".join(parts) + f" in {a.window_s:.2f} s{extra}"


def _kb(n: int) -> str:
    return f"{n / 1024:.0f} KB" if n >= 1024 else f"{n} B"


def net_wakeups(a: Activity) -> int | None:
    """The main thread's wakeups that py-spy's attaches do not explain."""
    return None if a.wakeups is None else max(0, a.wakeups - WAKEUPS_PER_ATTACH * a.attaches)


def judge(a: Activity | None, backend: str | None = None) -> Judgement | None:
    """What the counters say of a rank that sat in a collective in every sample; None when
    nothing was measured. ``backend``: the rank's process-group backend where the recorder or
    heartbeat names it (else the backends its threads name)."""
    if a is None:
        return None
    said = numbers(a)
    if a.stopped:
        return Judgement(Motion.STUCK, said, "its process is stopped (SIGSTOP, job control)")
    backends = {backend} if backend else set(a.backends)
    if backends & set(BLIND_BACKENDS):
        return Judgement(Motion.CANNOT_TELL, said,
                         "on NCCL these counters cannot tell (its transport needs no "
                         "syscalls; a CUDA wait does not wake the thread)")
    net = net_wakeups(a)
    if net is None:
        return Judgement(Motion.CANNOT_TELL, said, "its counters could not be read")
    wake_s = net / a.window_s
    sys_s = None if a.syscalls is None else a.syscalls / a.window_s
    kb_s = None if a.io_bytes is None else a.io_bytes / 1024 / a.window_s
    if wake_s >= MOVING_WAKEUPS_S and sys_s is not None and sys_s >= MOVING_SYSCALLS_S:
        return Judgement(Motion.MOVING, said,
                         "collectives keep completing")
    if wake_s <= STUCK_WAKEUPS_S and kb_s is not None and kb_s <= STUCK_KB_S:
        return Judgement(Motion.STUCK, said, "nothing completed")
    if wake_s <= STUCK_WAKEUPS_S:
        return Judgement(Motion.CANNOT_TELL, said,
                         "its main thread never woke but data moved (one long collective, "
                         "or another thread's I/O)" if kb_s is not None
                         else "its main thread never woke; its I/O could not be read")
    return Judgement(Motion.CANNOT_TELL, said,
                     "between what a loop of collectives and a stuck rank show")
