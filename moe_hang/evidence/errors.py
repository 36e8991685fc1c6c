"""Exceptions that ended ranks, and which of them are the root cause (pure).

Sources: the probe's ``error.json`` (type, message, frames, time), and the ``[rankN]:``
traceback blocks torch prints into the job log for an uncaught exception. A rank that fails
*because* a peer failed raises a communication error (gloo's "Connection reset/closed by peer",
"Timed out waiting ... for recv", NCCL's watchdog timeout); those are consequences. Anything
else is a root cause, and the earliest root cause is the one to fix (docs/DESIGN.md §8).
"""

from __future__ import annotations

import re
from dataclasses import replace

from moe_hang.evidence.model import RankError
from moe_hang.evidence.stacks import Frame

# A communication failure seen by a rank whose peer died, aborted or left: a consequence.
_CONSEQUENCE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Connection refused|Broken pipe|"
    r"Timed out waiting \d+ ?ms for (?:recv|send)|Application timeout caused pair closure|"
    r"Socket Timeout|timed out after|Watchdog caught collective operation timeout|"
    r"NCCL communicator was aborted|ProcessGroupNCCL is aborted|"
    r"Detected mismatch between collectives on ranks|"
    r"failed to pass monitoredBarrier|monitoredBarrier|"
    r"DistNetworkError|DistBackendError: .*(?:reset|closed|timed out|Timed out|abort)|"
    r"Rank \d+ is not reachable|ECONNRESET|EPIPE|"
    # NCCL's ncclRemoteError: a peer of this rank's communicator went away
    r"remote process exited or there was a network error|ncclRemoteError|"
    r"Signal \d+ \(SIGTERM\)|got signal: 15|SignalException", re.IGNORECASE)
_CONSEQUENCE_TYPES = ("KeyboardInterrupt", "SystemExit", "ChildFailedError", "SignalException")


# A collective's own check failing on mismatched peers (gloo's enforce in a collective, not in
# its transport; DETAIL's fingerprint check): a symptom of a desync, which the alignment names
_MISMATCH = re.compile(
    r"enforce fail at [^\]]*gloo/(?!transport/)|Received data size doesn't match|"
    r"Detected mismatch between collectives on ranks", re.IGNORECASE)


def is_mismatch_report(err: RankError) -> bool:
    """The error is a collective's check that its peers posted something else."""
    return bool(_MISMATCH.search(f"{err.type}: {err.message}"))


_MONITORED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def monitored_barrier_laggards(err: RankError) -> list[int]:
    """``monitored_barrier`` names the ranks that did not reach it in time."""
    m = _MONITORED.search(err.message)
    return sorted({int(x) for x in re.findall(r"\d+", m.group(1))}) if m else []


def is_consequence(err: RankError) -> bool:
    """The error says a peer failed (or torchrun tore the job down), not what went wrong."""
    if err.type.rsplit(".", 1)[-1] in _CONSEQUENCE_TYPES:
        return True
    return bool(_CONSEQUENCE.search(f"{err.type}: {err.message}"))


_PREFIX = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)|"
                       r"[A-Za-z_][\w.]*\.[A-Z]\w*)(?::\s?(.*))?$")
# a traceback carried inside an exception's text: torch's ExceptionWrapper (DataLoader workers,
# the pin-memory thread) writes "Original Traceback (most recent call last):"; a wrapper that
# embeds traceback.format_exc() writes the plain heading
_EMBEDDED_TB = re.compile(r"^\s*(?:Original )?Traceback \(most recent call last\):\s*$")


def _traceback_body(lines: list[str]) -> tuple[list[Frame], tuple[str, str] | None, list[str]]:
    """A traceback's lines after its heading: (frames, innermost first; the ``Type: message``
    line that follows them; the lines after that one: the rest of a multi-line message)."""
    frames: list[Frame] = []
    for i, ln in enumerate(lines):
        fm = _FRAME.match(ln)
        if fm:
            frames.append(Frame(fm.group(1), int(fm.group(2)), fm.group(3)))
            continue
        em = _EXC_LINE.match(ln.strip())
        if em and frames and not ln.startswith((" ", "\t")):
            return (list(reversed(frames)), (em.group(1), (em.group(2) or "").strip()),
                    lines[i + 1:])
    return list(reversed(frames)), None, []


def unwrap(err: RankError, text: str | None = None) -> RankError:
    """The original exception when ``err`` re-raised one whose traceback it carries as text
    (``text``: its whole message, by default ``err.message``): the original's type and
    message, its frames (innermost first: where it was raised) followed by ``err``'s own, and
    ``wrapped_by`` = what re-raised it (``KeyError: Caught KeyError in DataLoader worker
    process 0.``). ``err`` itself when the text holds no traceback that ends in an exception."""
    lines = (err.message if text is None else text).splitlines()
    start = max((i for i, ln in enumerate(lines) if _EMBEDDED_TB.match(ln)), default=None)
    if start is None:
        return err
    frames, exc, _rest = _traceback_body(lines[start + 1:])
    if exc is None:
        return err
    head = " ".join(ln.strip() for ln in lines[:start] if ln.strip())
    return replace(err, type=exc[0], message=exc[1][:500], frames=frames + err.frames,
                   wrapped_by=f"{err.type}: {head}"[:500] if head else err.type)


def with_original(recorded: RankError, logged: RankError | None) -> RankError:
    """The probe's record of an exception, with the original the job log's copy of the same
    exception carries (the probe keeps the message's first line only, the log all of it);
    ``recorded`` as it is otherwise."""
    if logged is None or logged.wrapped_by is None or recorded.wrapped_by is not None:
        return recorded
    same = f"{recorded.type}: {recorded.message}".strip()
    if not same or not logged.wrapped_by.startswith(same):
        return recorded
    return replace(logged, time=recorded.time, source=recorded.source, restart=recorded.restart)


def log_tracebacks(text: str) -> dict[int, RankError]:
    """The last traceback each rank printed (``[rankN]: Traceback ...`` blocks), with its
    frames (innermost first) and its final ``Type: message`` line; ``seen_at`` is the log line
    it starts on (the log has no clock, but the order ranks printed in). An exception whose
    message carries another's traceback (a DataLoader worker's) is that original one
    (:func:`unwrap`)."""
    lines: dict[int, list[str]] = {}
    at: dict[int, list[int]] = {}
    for i, raw in enumerate(text.splitlines()):
        m = _PREFIX.match(raw)
        if m:
            r = int(m.group(1))
            lines.setdefault(r, []).append(m.group(2))
            at.setdefault(r, []).append(i)
    out: dict[int, RankError] = {}
    for r, body in lines.items():
        start = max((i for i, ln in enumerate(body) if ln.strip().startswith("Traceback (")),
                    default=None)
        if start is None:
            continue
        frames, exc, rest = _traceback_body(body[start + 1:])
        if exc is None:
            continue
        err = RankError(type=exc[0], message=exc[1][:500], frames=frames, time=None,
                        source="job log", seen_at=at[r][start])
        out[r] = unwrap(err, "\n".join([exc[1], *rest])) if rest else err
    return out


_BUILD_PATH = re.compile(r"\[(?:enforce fail at )?/[^\]]*\]\s*")


def without_build_paths(message: str) -> str:
    """gloo's and NCCL's messages without the build machine's source paths in front
    (``[enforce fail at /pytorch/third_party/gloo/...] ``): what they say, only."""
    return _BUILD_PATH.sub("", message).strip()
