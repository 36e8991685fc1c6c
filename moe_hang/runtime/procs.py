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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

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


class _Deferred:
    depth = 0
    pending: Callable[[], None] | None = None


@contextlib.contextmanager
def starting_child() -> Iterator[None]:
    """Start a child and record it (in a tracker, in the caller's variable) with no interrupt
    in between: a Ctrl-C raised between fork and the bookkeeping would leave a child no
    teardown knows about. An interrupt that arrives inside is raised on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers only run in the main thread
        return
    _Deferred.depth += 1
    try:
        yield
    finally:
        _Deferred.depth -= 1
        if _Deferred.depth == 0 and _Deferred.pending is not None:
            fire, _Deferred.pending = _Deferred.pending, None
            fire()


def defer_interrupt(fire: Callable[[], None]) -> bool:
    """For a signal handler: inside :func:`starting_child`, keep ``fire`` for its exit and
    return True; elsewhere return False (the handler acts now)."""
    if _Deferred.depth > 0:
        _Deferred.pending = _Deferred.pending or fire
        return True
    return False


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def main_thread_cpu(pid: int) -> float | None:
    """CPU seconds of ``pid``'s main thread alone (``/proc/PID/task/PID/stat``).

    The main thread is the one that posts collectives and blocks in them. Other threads of a
    blocked rank may still work (the probe answering a dump request, torch's watchdog, a data
    loader), so their CPU says nothing about whether the rank is stuck."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------- counters
# What a process did, readable without ptrace (docs/DESIGN.md §9): a rank blocked in a
# collective that never completes does nothing; one that keeps completing them wakes its main
# thread and drives its transport's syscalls every time.

# torch's process-group threads name their backend (c10::setThreadName)
_BACKEND_THREADS = (("pt_gloo", "gloo"), ("gloo_tcp", "gloo"), ("pt_nccl", "nccl"),
                    ("pt_xccl", "xccl"))


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of one process at one instant (``/proc``). None: not readable
    (``/proc/PID/io`` needs the same rights as ptrace's read mode; a non-dumpable process
    hides it)."""

    at: float  # time.monotonic() of the reading
    wakeups: int | None  # voluntary context switches of the main thread (/proc/PID/status)
    preempted: int | None  # its involuntary ones
    syscalls: int | None  # read + write syscalls of the whole process (syscr + syscw)
    io_bytes: int | None  # bytes through them (rchar + wchar): files, pipes, sockets
    # tid -> (syscalls, bytes) of each thread, to leave the tool's own threads out
    threads_io: dict[int, tuple[int, int]] = field(default_factory=dict)
    stopped: bool = False  # state T: SIGSTOP, job control (a tracing stop is "t")
    backends: tuple[str, ...] = ()  # from its threads' names: gloo, nccl, xccl


def _kv(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def _io(path: str) -> tuple[int, int] | None:
    try:
        d = _kv(Path(path).read_text())
        return int(d["syscr"]) + int(d["syscw"]), int(d["rchar"]) + int(d["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def is_stopped(pid: int) -> bool:
    """``pid`` is stopped (state T: SIGSTOP, job control), not merely sleeping."""
    try:
        return _kv(Path(f"/proc/{pid}/status").read_text()).get("State", "").startswith("T")
    except OSError:
        return False


def read_counters(pid: int) -> Counters | None:
    """The counters of ``pid`` now; None when it is gone."""
    at = time.monotonic()
    try:
        status = _kv(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    try:
        wakeups: int | None = int(status["voluntary_ctxt_switches"])
        preempted: int | None = int(status["nonvoluntary_ctxt_switches"])
    except (KeyError, ValueError):
        wakeups = preempted = None
    whole = _io(f"/proc/{pid}/io")
    threads: dict[int, tuple[int, int]] = {}
    backends: set[str] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for t in tids:
        if not t.isdigit():
            continue
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            backends.update(b for prefix, b in _BACKEND_THREADS if name.startswith(prefix))
        if whole is not None and (io := _io(f"/proc/{pid}/task/{t}/io")) is not None:
            threads[int(t)] = io
    return Counters(at=at, wakeups=wakeups, preempted=preempted,
                    syscalls=whole[0] if whole else None, io_bytes=whole[1] if whole else None,
                    threads_io=threads, stopped=status.get("State", "").startswith("T"),
                    backends=tuple(sorted(backends)))


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


def helpers_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """Every live descendant of ``pid`` (DataLoader workers, compile workers): pid ->
    (create time, CPU seconds). A rank waiting on its own helpers is working, not stuck."""
    out = {}
    for c in descendants(pid):
        try:
            t = c.cpu_times()
            out[c.pid] = (c.create_time(), float(t.user + t.system))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def helpers_cores(before: dict[int, tuple[float, float]],
                  after: dict[int, tuple[float, float]], span_s: float) -> float:
    """Cores the helpers kept busy between two readings: each one seen at the end, from its
    reading at the start (a pid reused by a newer process, or one started since, from zero
    at its start; one that ended in between is not counted)."""
    used = 0.0
    for pid, (born, cpu) in after.items():
        was = before.get(pid)
        used += cpu - was[1] if was is not None and was[0] == born else cpu
    return max(0.0, used) / max(span_s, 1e-3)


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
             first_signal: int = signal.SIGTERM, group: bool = False) -> list[int]:
    """End a job the way its launcher would, then make sure. Returns pids that would not die.

    1. ``first_signal`` to the root (to its whole process group with ``group``, as a
       terminal's Ctrl-C): torchrun forwards it to its workers, srun and mpirun to their
       tasks; up to ``grace`` seconds for the root to exit.
    2. Everything it started that is still alive gets SIGTERM itself, as a launcher ends its
       ranks: mp.spawn's parent dies of SIGTERM (or hangs joining ranks that a SIGINT cannot
       reach inside a collective) and leaves its ranks running; a hand-written launcher may
       forward nothing. Up to ``grace`` seconds more (each rank's probe dumps on the way).
    3. SIGKILL to whatever is left, then up to 5 s for it to go."""
    if popen is not None:
        tracker.add_tree(popen.pid)
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group:
                    os.killpg(popen.pid, first_signal)
                else:
                    popen.send_signal(first_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=grace)
    left = tracker.wait_gone(0.5 if popen is not None else grace)
    if left and popen is not None:
        tracker.signal_all(signal.SIGTERM, left)
        left = tracker.wait_gone(grace)
    if left:
        tracker.signal_all(signal.SIGKILL, left)
        left = tracker.wait_gone(5.0)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=2.0)
    return left
