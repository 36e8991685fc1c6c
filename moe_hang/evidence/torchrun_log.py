"""What the job's own log says: torchrun's failure table and root cause, the ``[rankN]:``
exception lines, gloo's size-mismatch abort, and the handful of lines a person needs (pure)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from moe_hang.evidence.model import SizeAbort

_NOTABLE = re.compile(
    r"enforce fail|Received data size|doesn't match|Detected mismatch|Timed out|timed out|"
    r"Watchdog caught|Connection reset|Connection closed|Broken pipe|collective operation timeout|"
    r"NCCL error|out of memory|Error:|Exception:|Fatal Python error|Killed|Segmentation fault")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s*")


def notable_log_lines(text: str, limit: int = 8) -> list[str]:
    """The handful of job-log lines a person needs (gloo aborts, timeouts, exceptions)."""
    seen: list[str] = []
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw).strip()
        if not line or not _NOTABLE.search(line) or line.startswith(("File ", "raise ")):
            continue
        if "ChildFailedError" in line or "torch.distributed.elastic" in line:
            continue
        line = line[:300]
        if line not in seen:
            seen.append(line)
        if len(seen) >= limit:
            break
    return seen


_GLOO_SIZE_ABORT = "Received data size doesn't match"
_GLOO_SIZE = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")


def gloo_size_abort(text: str) -> SizeAbort | None:
    """gloo's size-mismatch abort anywhere in a job log (not only its first notable lines)."""
    if _GLOO_SIZE_ABORT not in text:
        return None
    m = _GLOO_SIZE.search(text)
    return SizeAbort(int(m.group(1)), int(m.group(2))) if m else SizeAbort()


_FAIL_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_FAIL_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\n\s*\[\d+\]:\s*\n"
                         r"(?:.*\n)*?\s*rank\s*:\s*(\d+)")
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]:\s*([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$")


def torchrun_root_cause(text: str) -> int | None:
    """The rank torchrun names under "Root Cause (first observed failure)"."""
    m = _ROOT_CAUSE.search(text)
    return int(m.group(1)) if m else None


def rank_errors_from_log(text: str) -> dict[int, str]:
    """The last ``[rankN]: SomeError: ...`` line of each rank (torchrun prefixes them)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        m = _RANK_ERROR.match(line.strip())
        if m:
            out[int(m.group(1))] = m.group(2)[:300]
    return out


def parse_torchrun_failures(text: str) -> dict[int, tuple[int, int]]:
    """torchrun's failure table -> {rank: (exitcode, pid)}."""
    out: dict[int, tuple[int, int]] = {}
    rank: int | None = None
    for line in text.splitlines():
        m = _FAIL_RANK.match(line)
        if m:
            rank = int(m.group(1))
            continue
        m = _FAIL_EXIT.match(line)
        if m and rank is not None:
            out[rank] = (int(m.group(1)), int(m.group(2)))
            rank = None
    return out


LOG_TAIL_BYTES = 16 << 20


def read_job_log(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The end of the job's output: torchrun's failure summary, the aborts and tracebacks that
    end a job are at its end, and a long training job's log may be gigabytes."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
