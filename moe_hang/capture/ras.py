"""Ask a live NCCL job for its RAS report (NCCL >= 2.24), bounded: through ``ncclras`` when it
is on PATH, else by speaking RAS's socket protocol at ``NCCL_RAS_ADDR`` (default
``localhost:28028``) — and two reports a few seconds apart, to tell frozen from moving
(:func:`take_two`; :func:`moe_hang.analysis.ras.compare.compare_reports` reads them).

Nothing is left behind: no thread, a socket closed on every way out, ``ncclras`` in its own
process group killed at the deadline. A failure is an answer with the reason (``error``), never
an exception, except a malformed ``NCCL_RAS_ADDR`` (the user's to fix: :class:`MoeHangError`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from moe_hang.capture.ncclras import NcclrasError, ask_binary, find_ncclras
from moe_hang.capture.ras_socket import RasProtocolError, ask
from moe_hang.errors import MoeHangError
from moe_hang.evidence.ras import DEFAULT_PORT, RasReport, RasReportError, parse_report

ENV_RAS_ADDR = "NCCL_RAS_ADDR"


@dataclass(frozen=True)
class RasEndpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def ras_endpoint(addr: str | None = None) -> RasEndpoint:
    """``host:port``, ``[v6]:port`` or ``host`` (port 28028); None: ``NCCL_RAS_ADDR``, else
    ``localhost:28028``, where NCCL's RAS thread listens."""
    raw = os.environ.get(ENV_RAS_ADDR, "") if addr is None else addr
    text = raw.strip()
    if not text:
        return RasEndpoint("localhost", DEFAULT_PORT)
    host, port = text, str(DEFAULT_PORT)
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not text[end + 1:].startswith(":")):
            raise MoeHangError(f"{ENV_RAS_ADDR}={raw!r} is not [address]:port")
        host, port = text[1:end], text[end + 2:] or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MoeHangError(f"{ENV_RAS_ADDR}={raw!r} is not host:port")
    return RasEndpoint(host, int(port))


@dataclass(frozen=True)
class RasAnswer:
    """One query: the report, or why there is none."""

    endpoint: RasEndpoint
    via: str  # "ncclras" | "socket"
    fmt: str  # what came back: json | text ("" when nothing did)
    text: str  # the report as RAS sent it ("" when none)
    report: RasReport | None
    error: str | None
    asked_at: float  # time.monotonic() when the status was asked for
    seconds: float  # the whole query
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.report is not None


def query_ras(endpoint: RasEndpoint | None = None, *, ras_timeout_s: int, fmt: str = "json",
              deadline_s: float | None = None, use: str = "auto") -> RasAnswer:
    """One RAS status report. ``ras_timeout_s``: what RAS waits for each peer while it
    gathers (``Settings.ras_timeout_s``). ``use``: "auto" (ncclras if found, else the socket),
    "ncclras", or "socket". ``deadline_s`` bounds the whole query (default: RAS's timeout +
    8 s, what ncclras itself would wait and a margin)."""
    ep = endpoint or ras_endpoint()
    t0 = time.monotonic()
    deadline = t0 + (ras_timeout_s + 8.0 if deadline_s is None else deadline_s)
    exe = find_ncclras() if use in ("auto", "ncclras") else None
    via = "ncclras" if exe else "socket"
    if use == "ncclras" and exe is None:
        return RasAnswer(ep, via, "", "", None, "ncclras is not on PATH", t0, 0.0)
    try:
        if exe:
            got = ask_binary(exe, ep.host, ep.port, fmt=fmt, ras_timeout_s=ras_timeout_s,
                             deadline=deadline)
            text, got_fmt, asked, notes = got.text, got.fmt, got.asked_at, got.notes
        else:
            sa = ask(ep.host, ep.port, fmt=fmt, ras_timeout_s=ras_timeout_s, deadline=deadline)
            text, got_fmt, asked, notes = sa.text, sa.fmt, sa.asked_at, sa.notes
    except (NcclrasError, RasProtocolError) as exc:
        return RasAnswer(ep, via, "", "", None, str(exc), t0, time.monotonic() - t0)
    try:
        report: RasReport | None = parse_report(text)
        error = None
    except RasReportError as exc:
        report, error = None, f"RAS at {ep} answered, but {exc}"
    return RasAnswer(ep, via, got_fmt, text, report, error, asked, time.monotonic() - t0,
                     tuple(notes))


@dataclass(frozen=True)
class RasPair:
    first: RasAnswer
    second: RasAnswer | None  # None when the first failed: nothing to compare
    interval_s: float | None  # between the two status requests (monotonic clock)


def take_two(interval_s: float, endpoint: RasEndpoint | None = None, *, ras_timeout_s: int,
             fmt: str = "json", deadline_s: float | None = None, use: str = "auto") -> RasPair:
    """Two reports ``interval_s`` apart (request to request); the second only if the first
    came back. The other keywords are :func:`query_ras`'s, for each query."""
    ep = endpoint or ras_endpoint()

    def one() -> RasAnswer:
        return query_ras(ep, fmt=fmt, ras_timeout_s=ras_timeout_s, deadline_s=deadline_s,
                         use=use)

    first = one()
    if not first.ok:
        return RasPair(first, None, None)
    time.sleep(max(0.0, first.asked_at + interval_s - time.monotonic()))
    second = one()
    return RasPair(first, second, second.asked_at - first.asked_at)
