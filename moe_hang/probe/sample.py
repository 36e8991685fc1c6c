"""What the probe reads off its own rank, in the rank (stdlib only; no torch import): the main
thread's frames and the peer of a send/recv it is blocked in, and the recorder entries still
pending in one of torch's Flight Recorder pickles."""

from __future__ import annotations

import pickle
import sys
import threading
from typing import Any

# what a thread calls from its own line to wait on a collective posted earlier (the probe
# imports nothing of the tool's other layers: evidence.source.WAIT_METHODS is the same set,
# tests/unit/test_probe_quiet.py holds them equal)
WAIT_METHODS = frozenset({"wait", "synchronize", "item", "cpu", "tolist", "result", "value"})

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




def _pushes_callable(ins: Any) -> tuple[bool, str | None]:
    """Does this instruction put a callable on the stack for a later CALL (and its name,
    where it is a method of an object)?"""
    rep = ins.argrepr or ""
    if ins.opname == "LOAD_METHOD":  # 3.11
        return True, ins.argval
    if ins.opname == "LOAD_ATTR" and rep.startswith("NULL|self + "):  # 3.12+
        return True, ins.argval
    if ins.opname == "PUSH_NULL" or (ins.opname == "LOAD_GLOBAL" and rep.startswith("NULL")):
        return True, None
    return False, None


def called_name(frame: Any) -> str | None:
    """The method the frame's current instruction calls (``work.wait()``: ``wait``), where
    it is a call of an object's method; else None. The callables of the calls still open
    at that instruction are followed through the bytecode (arguments may be calls too)."""
    import dis

    try:
        code, at = frame.f_code, frame.f_lasti
        # f_lasti may point into the current instruction's inline caches
        done = [ins for ins in dis.get_instructions(code) if ins.offset <= at]
        if not done or done[-1].opname not in ("CALL", "CALL_FUNCTION_EX"):
            return None
        open_calls: list[str | None] = []
        for ins in done[:-1]:
            if ins.opname in ("CALL", "CALL_FUNCTION_EX"):
                if open_calls:
                    open_calls.pop()
                continue
            pushes, name = _pushes_callable(ins)
            if pushes:
                open_calls.append(name if isinstance(name, str) else None)
        return open_calls[-1] if open_calls else None
    except Exception:
        return None


def quiet_for_imports(main_ident: int | None) -> bool:
    """The moment is safe for our thread to import (torch's symbolizer imports torch._dynamo):
    the main thread waits — inside torch.distributed, or in a C call of a wait from its own
    line — so it imports nothing until that returns, and no thread is inside an import now.
    Called on the main thread itself (the probe's hook of an uncaught exception), the main
    thread imports only what the caller does: no thread inside an import is enough."""
    if main_ident is None or threading.get_ident() != main_ident:
        frame = sys._current_frames().get(main_ident or -1)
        if frame is None:
            return False
        in_c10d = "torch/distributed/" in frame.f_code.co_filename.replace("\\", "/")
        if not in_c10d and called_name(frame) not in WAIT_METHODS:
            return False
    locks = getattr(sys.modules.get("_frozen_importlib"), "_module_locks", None)
    return isinstance(locks, dict) and not locks
