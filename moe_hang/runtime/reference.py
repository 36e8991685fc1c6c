"""The single-process reference's child process, from the parent's side: waited for within a
bound, and its report read back (``reference.json``) — else the tail of its log says why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from moe_hang.analysis.runs import ReferenceReport
from moe_hang.errors import MoeHangError


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
