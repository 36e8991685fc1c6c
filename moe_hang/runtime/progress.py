"""Did each live rank move over a short window (:class:`ProgressSample`): its heartbeat's
fingerprint or its main thread's CPU time, read twice."""

from __future__ import annotations

import time
from pathlib import Path

from moe_hang.evidence.heartbeats import read_heartbeats
from moe_hang.runtime.procs import main_thread_cpu

CPU_MOVING_S = 0.02  # main-thread CPU seconds over a window that count as moving


class ProgressSample:
    """Did each live rank move between two readings (heartbeat fingerprint or CPU time)?

    Used on ranks left orphaned by a dead agent: a job that was healthy when its launcher died
    keeps stepping, and a snapshot of ranks in flight (one in all_gather, one already in
    all_reduce) must not be read as a desync. A rank blocked in a collective burns next to no
    CPU and its heartbeat does not change."""

    def __init__(self, probe_dir: Path, pids: dict[int, int]):
        self.probe_dir, self.pids = probe_dir, dict(pids)
        self.t0 = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict[int, tuple[str, float | None]]:
        # the main thread's CPU only: the window covers the dump requests, which the probe's
        # own thread answers, with CPU, in a rank that is blocked all the same
        hbs = read_heartbeats(self.probe_dir)
        return {r: (hb.fingerprint() if (hb := hbs.get(r)) else "", main_thread_cpu(pid))
                for r, pid in self.pids.items()}

    def finish(self, min_window_s: float = 1.0) -> dict[int, bool]:
        """Bounded: waits at most ``min_window_s`` beyond the first reading."""
        time.sleep(max(0.0, min_window_s - (time.monotonic() - self.t0)))
        after = self._read()
        moved: dict[int, bool] = {}
        for r, (fp, cpu) in self.before.items():
            fp2, cpu2 = after[r]
            if cpu is None or cpu2 is None:
                continue  # gone meanwhile: the liveness check speaks for it
            moved[r] = fp2 != fp or cpu2 - cpu > CPU_MOVING_S
        return moved
