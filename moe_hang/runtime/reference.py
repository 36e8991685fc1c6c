"""The single-process reference's child process, from the parent's side: waited for within a
bound, and its report read back (``reference.json``) — else the tail of its log says why."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

from moe_hang.analysis.runs import ReferenceReport
from moe_hang.errors import MoeHangError
from moe_hang.runtime.procs import Tracker, end_tree


def start_reference(args: list[str], log_path: Path, env: dict[str, str], *,
                    when_told: bool = False) -> subprocess.Popen[bytes]:
    """``python -m moe_hang.usercheck.reference ARGS`` in a session of its own, its output in
    ``log_path``; ``when_told``: it computes now and compares once :func:`finish_reference`
    says so (the runs it compares with still run)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "moe_hang.usercheck.reference", *args,
             *(["--when-told"] if when_told else [])],
            stdin=subprocess.PIPE if when_told else subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish_reference(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float, *,
                     compare: bool = True) -> None:
    """Tell it to compare (or, ``compare=False``, to stop: the runs failed) and wait for it
    within ``timeout_s``; it is ended whatever happens."""
    tracker = Tracker()
    tracker.add(proc.pid)
    try:
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.write(b"compare\n" if compare else b"")
                proc.stdin.close()
        if compare:
            await_reference(proc, timeout_s, log_path)
    finally:
        end_tree(proc, tracker, grace=1.0)


def await_reference(proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Block until the reference exits; past ``timeout_s`` a clear error (the caller ends the
    process tree whatever happens)."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise MoeHangError(f"the single-process reference did not finish within "
                           f"{timeout_s:.0f} s (see {log})") from None


def reference_report(report: Path, log: Path, tail: int = 400) -> ReferenceReport:
    """What the reference wrote, or an error with the end of its log."""
    try:
        return ReferenceReport.parse(json.loads(report.read_text()))
    except (OSError, ValueError, TypeError):
        text = log.read_text(errors="replace").strip()[-tail:] if log.exists() else ""
        raise MoeHangError(f"the single-process reference failed: {text or 'no output'}"
                           ) from None
