"""Waiting on the small hung jobs (stdlib at import; psutil and moe_hang.procs where a wait needs
them): shared by tests/conftest.py, scripts/bench.py, scripts/soak.py and the jobs themselves
(tests/e2e/jobs/_common.py). Every wait is bounded and raises AssertionError when it runs out."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def wait_blocked(pids: list[int], timeout: float = 60.0) -> None:
    """Until every pid's main thread used no CPU over 0.3 s (blocked, e.g. in a collective)."""
    from moe_hang.runtime.procs import main_thread_cpu

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = {p: main_thread_cpu(p) for p in pids}
        time.sleep(0.3)
        after = {p: main_thread_cpu(p) for p in pids}
        if all(before[p] is not None and before[p] == after[p] for p in pids):
            return
    raise AssertionError(f"ranks {pids} did not block within {timeout} s")


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` is gone or a zombie."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running after {timeout} s")


def wait_files(directory: Path, pattern: str, count: int, timeout: float,
               proc: subprocess.Popen[Any] | None = None, what: str = "") -> None:
    """Until ``count`` files match ``directory/pattern``; fails at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(pattern))) < count:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what or pattern}: the process exited first "
                                 f"(code {proc.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or pattern}: not there within {timeout} s")
        time.sleep(0.05)


def wait_marks(marks: Path, nproc: int, proc: subprocess.Popen[Any] | None, timeout: float,
               name: str = "hang") -> None:
    """Until ``nproc`` ranks wrote ``<marks>/<name>.rank*`` (see tests/e2e/jobs/_common.mark)."""
    wait_files(marks, f"{name}.rank*", nproc, timeout, proc,
               what=f"{nproc} ranks reaching {name!r}")


def processes_mentioning(needle: str) -> list[Any]:
    """Live (non-zombie) psutil processes, other than this one, whose command line mentions
    ``needle`` — of this pytest-xdist worker's tests only: another worker's test may run the
    same job script at the same time (its processes inherit its worker's name)."""
    import psutil

    found = []
    me = os.getpid()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(needle in part for part in (p.info["cmdline"] or [])) and (
                    worker is None
                    or p.environ().get("PYTEST_XDIST_WORKER", worker) == worker):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
