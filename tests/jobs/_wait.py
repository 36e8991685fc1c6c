"""Waiting on the small hung jobs from outside (stdlib + psutil, no pytest, no torch): shared by
tests/conftest.py and scripts/bench.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid``'s main thread, in clock ticks; None if it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime of the main thread
    except (OSError, IndexError, ValueError):
        return None


def wait_blocked(pids: list[int], timeout: float = 60.0) -> None:
    """Until every pid's main thread is asleep and used no CPU over 0.3 s; AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = {p: cpu_ticks(p) for p in pids}
        time.sleep(0.3)
        after = {p: cpu_ticks(p) for p in pids}
        if all(before[p] is not None and before[p] == after[p] for p in pids):
            return
    raise AssertionError(f"ranks {pids} did not block within {timeout} s")


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` is gone or a zombie; AssertionError after ``timeout`` seconds."""
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


def wait_marks(marks: Path, nproc: int, proc: subprocess.Popen[Any], timeout: float,
               name: str = "hang") -> bool:
    """Until ``nproc`` ranks wrote ``<marks>/<name>.rank*`` (see tests/jobs/_common.mark):
    True, or False as soon as ``proc`` exited or ``timeout`` seconds passed first."""
    deadline = time.monotonic() + timeout
    while len(list(marks.glob(f"{name}.rank*"))) < nproc:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
