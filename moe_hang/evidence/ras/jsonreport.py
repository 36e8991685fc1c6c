"""NCCL's JSON RAS report (``ncclras -f json``, ``SET FORMAT json``; NCCL >= 2.28.7) -> a
:class:`RasReport` — pure.

The writer (``client_support.cc``, ``json*`` functions) prints fixed fields with printf, so the
layout is stable: ``nccl_version``, CUDA versions, a local ``timestamp``, ``communicators[]``
(``hash`` as ``0x%lx``, ``secondary_hash``, ``size``, ``ranks[]`` with ``status`` and
``collective_counts``, ``missing_ranks[]`` with ``unresponsive``/``considered_dead``) and
``ras`` (collection time, timeouts). Host is an IP address; an unfound process is host
"unknown", pid -1.

NCCL 2.28.7 and 2.28.9 print ``"nvml_dev": N`` of a *missing* rank with no comma before its
``"status"`` (fixed in 2.29.2), so every report with a missing rank is invalid JSON. That one
defect is repaired, exactly where it occurs; any other syntax error is refused with its reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moe_hang.evidence.ras.records import (
    RasCommunicator,
    RasMissingRank,
    RasRank,
    RasRankFlags,
    RasReport,
    RasReportError,
)

# a missing rank's "nvml_dev" line directly followed by its status object, which begins with
# "unresponsive" (a live rank's begins with "init_state", and has its comma)
_MISSING_COMMA = re.compile(r'("nvml_dev":[ \t]*-?\d+)(?=[ \t]*\r?\n[ \t]*"status":[ \t]*\{'
                            r'[ \t]*\r?\n[ \t]*"unresponsive")')
REPAIRED_COMMA = ("the missing comma after a missing rank's nvml_dev "
                  "(a defect of NCCL 2.28.7 and 2.28.9)")


def canonical_hash(value: Any, where: str) -> str:
    """``0xae94423cfbb2ef4a`` / ``ae94423cfbb2ef4a`` / ``0x2fda2edc54faea7`` -> 16 hex digits."""
    text = str(value).strip().lower()
    try:
        return f"0x{int(text, 16):016x}"
    except ValueError:
        raise RasReportError(f"{where}: hash {value!r} is not hexadecimal") from None


def loads_json(text: str) -> tuple[Any, str]:
    """The decoded document and what was repaired ("" if nothing)."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as first:
        repaired, n = _MISSING_COMMA.subn(r"\1,", text)
        if n:
            try:
                return json.loads(repaired), REPAIRED_COMMA
            except json.JSONDecodeError as again:
                raise RasReportError(f"not valid JSON, even with {REPAIRED_COMMA} repaired: "
                                     f"{again.msg} at line {again.lineno} column "
                                     f"{again.colno}") from None
        raise RasReportError(f"not valid JSON: {first.msg} at line {first.lineno} column "
                             f"{first.colno}") from None


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise RasReportError(f"{where} is not an object")
    return v


def _int(d: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in d:
        if default is None:
            raise RasReportError(f"{where}: no {key!r}")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise RasReportError(f"{where}: {key!r} is {v!r}, not an integer")
    return v


def _bool(d: dict[str, Any], key: str, where: str) -> bool:
    v = d.get(key, False)  # absent: false (every release writes it; be lenient on extras)
    if not isinstance(v, bool):
        raise RasReportError(f"{where}: {key!r} is {v!r}, not true/false")
    return v


def _counts(v: Any, where: str) -> dict[str, int]:
    if v is None:
        return {}
    d = _obj(v, where)
    out: dict[str, int] = {}
    for op, n in d.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise RasReportError(f"{where}: {op!r} is {n!r}, not a count")
        out[str(op)] = n
    return out


def _rank(v: Any, where: str) -> RasRank:
    d = _obj(v, where)
    st = _obj(d.get("status", {}), f"{where}.status")
    flags = RasRankFlags(init_state=_int(st, "init_state", f"{where}.status", 0),
                         async_error=_int(st, "async_error", f"{where}.status", 0),
                         finalize_called=_bool(st, "finalize_called", f"{where}.status"),
                         destroy_flag=_bool(st, "destroy_flag", f"{where}.status"),
                         abort_flag=_bool(st, "abort_flag", f"{where}.status"))
    return RasRank(rank=_int(d, "rank", where), host=str(d.get("host", "unknown")),
                   pid=_int(d, "pid", where, -1), cuda_dev=_int(d, "cuda_dev", where, -1),
                   nvml_dev=_int(d, "nvml_dev", where, -1), flags=flags,
                   collective_counts=_counts(d.get("collective_counts"),
                                             f"{where}.collective_counts"))


def _missing(v: Any, where: str) -> RasMissingRank:
    d = _obj(v, where)
    st = _obj(d.get("status", {}), f"{where}.status")
    return RasMissingRank(rank=_int(d, "rank", where), host=str(d.get("host", "unknown")),
                          pid=_int(d, "pid", where, -1), cuda_dev=_int(d, "cuda_dev", where, -1),
                          nvml_dev=_int(d, "nvml_dev", where, -1),
                          unresponsive=_bool(st, "unresponsive", f"{where}.status"),
                          considered_dead=_bool(st, "considered_dead", f"{where}.status"))


def _list(d: dict[str, Any], key: str, where: str) -> list[Any]:
    v = d.get(key, [])
    if not isinstance(v, list):
        raise RasReportError(f"{where}: {key!r} is not a list")
    return v


def _communicator(v: Any, where: str) -> RasCommunicator:
    d = _obj(v, where)
    if "hash" not in d:
        raise RasReportError(f"{where}: no 'hash'")
    ranks = tuple(_rank(r, f"{where}.ranks[{i}]")
                  for i, r in enumerate(_list(d, "ranks", where)))
    missing = tuple(_missing(r, f"{where}.missing_ranks[{i}]")
                    for i, r in enumerate(_list(d, "missing_ranks", where)))
    size = _int(d, "size", where, len(ranks) + len(missing))
    return RasCommunicator(hash=canonical_hash(d["hash"], where), size=size, ranks=ranks,
                           missing_ranks=missing,
                           secondary_hash=str(d.get("secondary_hash", "")).lower())


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_json_report(text: str) -> RasReport:
    """The JSON report's text -> :class:`RasReport` (raises :class:`RasReportError`)."""
    data, repaired = loads_json(text)
    top = _obj(data, "the report")
    if "communicators" not in top:
        raise RasReportError("the JSON has no 'communicators': not a RAS report")
    comms = tuple(_communicator(c, f"communicators[{i}]")
                  for i, c in enumerate(_list(top, "communicators", "the report")))
    ras_raw = top.get("ras")
    ras: dict[str, Any] = ras_raw if isinstance(ras_raw, dict) else {}
    t = ras.get("collection_time_sec")
    return RasReport(fmt="json", nccl_version=str(top.get("nccl_version", "")),
                     communicators=comms, timestamp=str(top.get("timestamp", "")),
                     cuda_runtime_version=_opt_int(top, "cuda_runtime_version"),
                     cuda_driver_version=_opt_int(top, "cuda_driver_version"),
                     collection_time_s=float(t) if isinstance(t, (int, float))
                     and not isinstance(t, bool) else None,
                     timeouts=_opt_int(ras, "timeouts_count") or 0, repaired=repaired)
