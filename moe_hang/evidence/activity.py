"""What one rank's process did over a sampling window, from counters the kernel keeps for
every process and that need no ptrace (pure data; docs/DESIGN.md §9).

A rank can sit in the same collective in every stack sample because it really is in one most
of the time — a different one each time (a loop of small all-reduces) — or because it is stuck
in one. Its counters tell them apart where the transport goes through syscalls (gloo, NCCL
over sockets): every collective that completes wakes the main thread waiting in it and moved
bytes through read/write syscalls. What they cannot see is said by
:mod:`moe_hang.analysis.activity`.

Only these numbers ever reach ``processes.json``: nothing of the environment, no names.
Per-process socket bytes are not recorded: Linux keeps them per network namespace
(``/proc/PID/net/dev``) or per socket (sock_diag), not per process; ``io_bytes`` counts what
went through read/write-family syscalls, sockets included where the transport writes with
them (gloo's receives use ``recv``, which these counters do not see: they count its sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Activity:
    """One rank's process over one window of ``window_s`` seconds. A count is None when it
    could not be read (``/proc/PID/io`` of a non-dumpable process, say)."""

    window_s: float
    wakeups: int | None = None  # voluntary context switches of the main thread
    preempted: int | None = None  # its involuntary ones (preemption: says nothing alone)
    syscalls: int | None = None  # read + write syscalls of the process (syscr + syscw)
    io_bytes: int | None = None  # bytes through them (rchar + wchar)
    # py-spy attached this many times within the window: each attach stops every thread and
    # wakes a blocked main thread once or twice, progress or not
    attaches: int = 0
    # threads of the tool's own (the probe answering a dump) whose I/O is left out above
    tool_threads: int = 0
    stopped: bool = False  # the process was stopped (SIGSTOP, job control) at the window's end
    backends: tuple[str, ...] = ()  # process-group backends its threads name: gloo, nccl

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"window_s": round(self.window_s, 3), "wakeups": self.wakeups,
                             "preempted": self.preempted, "syscalls": self.syscalls,
                             "io_bytes": self.io_bytes, "attaches": self.attaches}
        if self.tool_threads:
            d["tool_threads"] = self.tool_threads
        if self.stopped:
            d["stopped"] = True
        if self.backends:
            d["backends"] = list(self.backends)
        return d

    @classmethod
    def parse(cls, data: Any) -> Activity | None:
        """Tolerant: anything that is not a window is None."""
        if not isinstance(data, dict):
            return None
        try:
            window = float(data["window_s"])
        except (KeyError, TypeError, ValueError):
            return None
        if window <= 0:
            return None
        backends = data.get("backends")
        return cls(window_s=window, wakeups=_int(data.get("wakeups")),
                   preempted=_int(data.get("preempted")), syscalls=_int(data.get("syscalls")),
                   io_bytes=_int(data.get("io_bytes")), attaches=_int(data.get("attaches")) or 0,
                   tool_threads=_int(data.get("tool_threads")) or 0,
                   stopped=data.get("stopped") is True,
                   backends=tuple(str(b) for b in backends) if isinstance(backends, list)
                   else ())
