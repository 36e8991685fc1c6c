"""What the probe reads off its own rank, in the rank (stdlib only; no torch import): the main
thread's frames and the peer of a send/recv it is blocked in, and the recorder entries still
pending in one of torch's Flight Recorder pickles."""

from __future__ import annotations

import pickle
import sys
from typing import Any

# c10d point-to-point functions, and the argument naming the peer
_P2P_ARG = {"send": ("send", "dst"), "isend": ("send", "dst"), "recv": ("recv", "src"),
            "irecv": ("recv", "src")}
_PENDING_KEYS = ("pg_id", "process_group", "collective_seq_id", "profiling_name", "input_sizes",
                 "output_sizes", "input_dtypes", "time_created_ns", "frames",
                 # with TORCH_NCCL_ENABLE_TIMING=1: scheduled -> started -> completed
                 "state", "time_discovered_started_ns", "time_discovered_completed_ns",
                 "duration_ms")


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def main_frame(ident: int | None, limit: int = 64) -> list[list[Any]] | None:
    """The thread's frames, innermost first, as [file, line, function]."""
    frame = sys._current_frames().get(ident or -1)
    out: list[list[Any]] = []
    while frame is not None and len(out) < limit:
        out.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    return out or None


def p2p_call(ident: int | None) -> dict[str, Any] | None:
    """The send/recv the thread is inside, with its peer: gloo's recorder keeps no
    point-to-point entries, and a stack does not show whom a rank waits for."""
    frame = sys._current_frames().get(ident or -1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _P2P_ARG and code.co_filename.endswith("distributed_c10d.py"):
            op, arg = _P2P_ARG[code.co_name]
            loc = frame.f_locals
            group = loc.get("group")
            return {"op": op, "peer": _as_int(loc.get(arg)), "tag": _as_int(loc.get("tag")),
                    "group": getattr(group, "group_name", None) if group is not None else None}
        frame = frame.f_back
    return None


def pending_entries(raw: bytes, status: dict[str, Any]) -> list[dict[str, Any]]:
    """The collectives of a recorder pickle that ``status`` says have not completed (torch
    wrote the pickle in this very process: no foreign globals)."""
    try:
        entries = pickle.loads(raw).get("entries", [])
    except Exception:
        return []
    out = []
    for e in entries:
        pg = str(e.get("pg_id"))
        if e.get("is_p2p") or pg not in status:
            continue
        if int(e.get("collective_seq_id", -1)) > status[pg]["completed"]:
            out.append({k: e.get(k) for k in _PENDING_KEYS})
    return out
