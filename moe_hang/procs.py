"""Process bookkeeping: track every process a command starts and end all of them.

torchrun starts every worker in its own session, so killing the agent's process group does not
reach the ranks, and a SIGKILLed agent leaves orphans blocked in collectives forever. So we keep
our own list of every descendant we have ever seen (pid + create time, so a recycled pid is
never mistaken for ours) and end each one. Zombies count as gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil


def is_alive(pid: int, create_time: float | None = None) -> bool:
    """Running (not a zombie) and, when given, the same process we saw before."""
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.05:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class CpuClock:
    """CPU seconds (user + system) of processes, read from /proc by the watcher itself.

    A rank's own heartbeat cannot speak for it when its interpreter holds the GIL for seconds
    (a full garbage collection, module teardown at exit): the probe thread is starved, yet the
    rank is busy, not blocked in a collective. Process objects are cached per pid (and checked
    against the pid's creation time, so a reused pid is not read as the rank); a pid gone (or
    not ours to read) gives None, and the watcher's own liveness check sees it die."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def seconds(self, pid: int) -> float | None:
        try:
            p = self._procs.get(pid)
            if p is not None and not p.is_running():  # gone, or the pid now names another
                del self._procs[pid]
                return None
            if p is None:
                p = self._procs[pid] = psutil.Process(pid)
            t = p.cpu_times()
            return float(t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            self._procs.pop(pid, None)
            return None


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


@dataclass
class Tracker:
    """Every process started on our behalf, by pid and create time."""

    seen: dict[int, float] = field(default_factory=dict)

    def add(self, pid: int) -> None:
        if pid in self.seen:  # the first sighting's create time is what identifies it
            return
        ct = create_time(pid)
        if ct is not None:
            self.seen.setdefault(pid, ct)

    def add_tree(self, root: int) -> None:
        self.add(root)
        for p in descendants(root):
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(p.pid, p.create_time())

    def alive(self) -> list[int]:
        return [pid for pid, ct in self.seen.items() if is_alive(pid, ct)]

    def signal_all(self, sig: int, pids: Iterable[int] | None = None) -> None:
        for pid in list(pids if pids is not None else self.alive()):
            # refresh descendants first: a rank may have children of its own
            for child in descendants(pid):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(child.pid, child.create_time())
            if is_alive(pid, self.seen.get(pid)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def wait_gone(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            left = self.alive()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)


def end_tree(popen: subprocess.Popen[bytes] | None, tracker: Tracker, *, grace: float = 3.0,
             first_signal: int = signal.SIGTERM) -> list[int]:
    """SIGTERM the root (torchrun forwards it to its workers), wait ``grace`` seconds, then
    SIGKILL everything still alive that we ever saw. Returns pids that would not die."""
    if popen is not None:
        tracker.add_tree(popen.pid)
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(first_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=grace)
    left = tracker.wait_gone(0.5 if popen is not None else grace)
    if left:
        tracker.signal_all(signal.SIGKILL, left)
        left = tracker.wait_gone(5.0)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=2.0)
    return left
