"""What the tool collected about a job, per rank, before any reasoning (pure data).

Capture code fills these from files and processes; :mod:`moe_hang.analysis` turns them into a
:class:`~moe_hang.diagnosis.Diagnosis`. Tests build them from recorded fixtures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moe_hang.frtrace import FRDump
from moe_hang.stacks import ThreadStack


@dataclass
class RankEvidence:
    rank: int
    pid: int | None = None
    host: str | None = None
    alive: bool | None = None  # None: unknown
    exit_code: int | None = None  # negative: killed by that signal (torchrun's convention)
    fr: FRDump | None = None
    fr_error: str | None = None
    threads: list[ThreadStack] | None = None
    stack_source: str | None = None  # py-spy | faulthandler | fatal | probe
    stack_error: str | None = None
    progressed: bool | None = None  # did it move between two samples?
    records: list[dict[str, Any]] = field(default_factory=list)  # probe's per-collective log
    heartbeat: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # a Python exception the rank recorded
    fatal: str | None = None  # faulthandler's fatal-signal text
    groups: dict[str, list[int]] | None = None  # pg name -> member ranks, from the probe
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SizeAbort:
    """gloo aborted a rank because a peer sent more bytes than it expected ("Received data size
    doesn't match expected size"); the byte counts when the log gives them."""

    received: int | None = None
    expected: int | None = None


@dataclass
class Evidence:
    ranks: dict[int, RankEvidence]
    world_size: int | None = None
    job: str = "stalled"  # completed | failed | stalled | running
    job_exit_code: int | None = None
    agent_exit_code: int | None = None  # the launcher itself, when it died by a signal
    root_cause_rank: int | None = None  # torchrun's "first observed failure"
    log_lines: list[str] = field(default_factory=list)  # for display only
    artifacts: str = ""
    size_abort: SizeAbort | None = None  # from the whole job log (see gloo_size_abort)


def said_exiting(heartbeat: dict[str, Any] | None) -> bool:
    """The probe's last beat says the rank's interpreter was shutting down normally (written
    at exit; an abort or a SIGKILL never gets there)."""
    return ((heartbeat or {}).get("progress") or {}).get("phase") == "exiting"


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
