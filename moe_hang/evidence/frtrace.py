"""Read Flight Recorder dumps: torch's pickle and JSON formats, NCCL and gloo alike (pure).

``torchfrtrace`` (torch 2.13) crashes on gloo dumps (``KeyError: ('0', 0)``: gloo's
``pg_config`` is keyed ``''``); this reader only relies on the per-entry fields every backend
writes: ``process_group``, ``collective_seq_id``, ``profiling_name``, sizes, dtypes, frames.

Dumps are unpickled with a restricted unpickler that refuses every global, so a dump from
someone else's directory cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.stacks import Frame, parse_probe_frames

DEFAULT_PG = "0"  # the default process group's name in Flight Recorder and the probe


@dataclass
class Collective:
    pg: str  # process group name, identical on every member rank ("0" = default_pg)
    seq: int  # collective_seq_id within that group
    op: str  # normalised: all_gather, all_reduce, reduce_scatter, all_to_all, barrier, ...
    raw_op: str = ""  # profiling_name as recorded, e.g. "gloo:all_gather"
    pg_desc: str = ""
    input_sizes: list[list[int]] = field(default_factory=list)
    output_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    time_created_ns: int | None = None
    frames: list[Frame] = field(default_factory=list)  # innermost first
    completed: bool | None = None
    source: str = "flight_recorder"  # flight_recorder | probe | heartbeat
    name: str | None = None  # the probe's step name (gather_tokens, combine, ...)
    phase: str | None = None  # forward | backward, when known
    tag: str | None = None  # the probe's identity of the collective (layer1.expert2)
    autograd_fn: str | None = None  # the autograd.Function whose backward posted it


@dataclass(frozen=True)
class PgStatus:
    """A process group's last enqueued and last completed sequence number (-1: none)."""

    enqueued: int
    completed: int

    @property
    def pending(self) -> bool:
        return self.enqueued > self.completed


@dataclass
class FRDump:
    entries: list[Collective]
    pg_status: dict[str, PgStatus]  # by process-group name
    pg_ranks: dict[str, list[int]] = field(default_factory=dict)
    version: str = ""
    backend: str = ""
    source: Path | None = None  # the file it was read from (load_dir)

    def by_pg(self) -> dict[str, list[Collective]]:
        out: dict[str, list[Collective]] = {}
        for e in self.entries:
            out.setdefault(e.pg, []).append(e)
        for v in out.values():
            v.sort(key=lambda c: c.seq)
        return out


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name} in a Flight Recorder dump")


def _sizes(v: Any) -> list[list[int]]:
    out = []
    for s in v or []:
        try:
            out.append([int(x) for x in s])
        except (TypeError, ValueError):
            continue
    return out


def entry_to_collective(e: dict[str, Any], source: str = "flight_recorder") -> Collective | None:
    if e.get("is_p2p"):
        return None
    pg = e.get("process_group") or ("", "")
    pg_name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
    pg_desc = str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else ""
    try:
        seq = int(e.get("collective_seq_id", -1))
    except (TypeError, ValueError):
        return None
    raw = str(e.get("profiling_name", ""))
    state = e.get("state")
    t_created = e.get("time_created_ns")
    return Collective(
        pg=pg_name, seq=seq, op=normalise_op(raw), raw_op=raw, pg_desc=pg_desc,
        input_sizes=_sizes(e.get("input_sizes")), output_sizes=_sizes(e.get("output_sizes")),
        dtypes=[str(d) for d in e.get("input_dtypes") or []],
        time_created_ns=int(t_created) if isinstance(t_created, (int, float)) else None,
        frames=parse_probe_frames(e.get("frames")),
        completed=True if state == "completed" else None, source=source)


def parse_dump(data: dict[str, Any]) -> FRDump:
    raw_entries = data.get("entries") or []
    if not isinstance(raw_entries, list):
        raise ValueError("Flight Recorder dump: 'entries' is not a list")
    entries = [c for c in (entry_to_collective(e) for e in raw_entries if isinstance(e, dict))
               if c is not None]
    id_to_name: dict[str, str] = {}
    for e in raw_entries:
        if isinstance(e, dict) and e.get("process_group"):
            id_to_name[str(e.get("pg_id"))] = str(e["process_group"][0])
    status: dict[str, PgStatus] = {}
    for pg_id, s in (data.get("pg_status") or {}).items():
        try:
            status[id_to_name.get(str(pg_id), str(pg_id))] = PgStatus(
                int(s.get("last_enqueued_collective", -1)),
                int(s.get("last_completed_collective", -1)))
        except (TypeError, ValueError, AttributeError):
            continue
    for c in entries:
        st = status.get(c.pg)
        if st is not None and st.completed >= 0:
            c.completed = c.seq <= st.completed
    pg_ranks: dict[str, list[int]] = {}
    for key, cfg in (data.get("pg_config") or {}).items():
        ranks = _parse_ranks(cfg.get("ranks") if isinstance(cfg, dict) else None)
        if key and ranks:  # gloo keys its only entry "" with no useful name
            pg_ranks[str(key)] = ranks
    backend = entries[0].raw_op.split(":", 1)[0] if entries and ":" in entries[0].raw_op else ""
    return FRDump(entries, status, pg_ranks, str(data.get("version", "")), backend)


def _parse_ranks(v: Any) -> list[int]:
    if isinstance(v, list):
        return [int(x) for x in v]
    if isinstance(v, str):
        return [int(x) for x in re.findall(r"-?\d+", v)]
    return []


def loads(raw: bytes) -> FRDump:
    """Parse a dump from bytes: JSON when it looks like JSON, else torch's pickle."""
    stripped = raw.lstrip()
    if stripped.startswith(b"{"):
        data = json.loads(stripped.decode("utf-8"))
    else:
        data = _NoGlobals(io.BytesIO(raw)).load()
    if not isinstance(data, dict):
        raise ValueError("Flight Recorder dump: not a mapping")
    return parse_dump(data)


def load(path: Path) -> FRDump:
    return loads(path.read_bytes())


_RANK_IN_NAME = re.compile(r"(?:rank|_)(\d+)(?:\.[a-z]+)*$|(\d+)(?:\.[a-z]+)*$")


def rank_from_filename(name: str) -> int | None:
    """``rank3.fr.pkl``, ``nccl_trace_rank_3``, ``fr_trace_3.json`` -> 3."""
    m = re.search(r"rank[_-]?(\d+)", name)
    if m:
        return int(m.group(1))
    m = _RANK_IN_NAME.search(name)
    if m:
        return int(m.group(1) or m.group(2))
    return None


def load_dir(directory: Path) -> tuple[dict[int, FRDump], dict[str, str]]:
    """Every dump in a directory, by rank; unreadable files are reported, not fatal."""
    dumps: dict[int, FRDump] = {}
    errors: dict[str, str] = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        rank = rank_from_filename(p.name)
        if rank is None:
            continue
        try:
            dumps[rank] = load(p)
            dumps[rank].source = p
        except Exception as exc:  # truncated, corrupt, not a dump: say so and go on
            errors[p.name] = f"{type(exc).__name__}: {exc}"[:200]
    return dumps, errors
