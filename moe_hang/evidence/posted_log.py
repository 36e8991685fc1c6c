"""A rank's posted log (``ranks/rank{R}.posted.jsonl``, written by the probe:
``moe_hang/probe/history.py``) read back as records — pure.

The log is the rank's Flight Recorder copied into a file as it ran, so it outlives the rank:
gloo's abort, a SIGKILL, ``os._exit``. It is complete up to the probe's last copy (every tick,
0.25 s, that a group posted something) and, where the rank's end could be caught (gloo's
``std::terminate``, ``os._exit``, an uncaught exception, SIGTERM, interpreter exit), up to its
last posted collective, with call-site frames. A SIGKILL or SIGSEGV leaves it as of the last
tick before.

One JSON object a line, ``kind`` first:

``start``   ``pid``, ``rank``, ``restart`` (torchrun's count), ``time``: a process began the
            log (a restarted rank appends; record ids start over). ``why: "recorder reset"``:
            the same process's recorder started its ids over. Only the last one's records count.
``entry``   one recorder entry, under the recorder's own names: ``record_id`` (the key: a
            later record of the same id supersedes an earlier one — the same entry again with
            its frames, or as it stood at the rank's end), ``pg_id``, ``process_group``
            ([name, desc]), ``collective_seq_id``, ``p2p_seq_id``, ``op_id``,
            ``profiling_name`` (``gloo:all_gather``), ``is_p2p``, ``input_sizes``,
            ``input_dtypes``, ``output_sizes``, ``output_dtypes``, ``time_created_ns``,
            ``state`` and ``retired`` (as when written), the timing fields where recorded
            (``time_discovered_started_ns``, ``time_discovered_completed_ns``,
            ``duration_ms``), ``thread_id`` (decimal pthread id, Python's ``get_ident()``),
            ``thread_name`` (the Python thread's name where the probe saw that thread alive,
            else the recorder's OS name) and ``stack`` (the id of its frames' record), each
            left out where unknown (frames: where the copy took them — always on the way out,
            on ticks only where symbolizing was cheap).
``stack``   ``id`` (a hash of the frames), ``frames``: [file, line, function], innermost first,
            at most 40 (a deeper stack keeps its innermost 32 and outermost 8; ``cut`` says
            how many were left out between).
``gap``     ``from``..``to`` (record ids, inclusive) are missing: the ring dropped them before
            a copy (``why: "ring"``) or the file was trimmed to its newest half
            (``why: "trimmed"``).
``status``  ``pg``: pg_id -> [last enqueued, last completed, last started] as the recorder's
            ``pg_status`` said at that copy (gloo counts ops there, as in its dumps).
``end``     ``reason`` (abort, os_exit, exception, sigterm, exit), ``time``: the last gasp.
            A log of a dead rank without one ended by a signal nothing can catch.

A line that is not such an object (the last one torn by a kill mid-write, or anything else)
is skipped; only lines other than a torn last one are noted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang.evidence.flight_recorder.parse import parse_dump
from moe_hang.evidence.flight_recorder.records import Collective, P2PEntry, PgStatus

MAX_READ = 64 << 20  # the probe keeps it under a few MB: anything past this is not its


@dataclass
class PostedLog:
    collectives: list[Collective] = field(default_factory=list)  # record order
    p2p: list[P2PEntry] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # record ids missing, inclusive
    end: str | None = None  # the last gasp's reason; None: none written
    notes: list[str] = field(default_factory=list)
    # by group name, from the last status record (as a dump's pg_status reads)
    status: dict[str, PgStatus] = field(default_factory=dict)
    op_lead: dict[str, int] = field(default_factory=dict)  # gloo: as FRDump.op_lead
    pg_names: dict[str, str] = field(default_factory=dict)  # as FRDump.pg_names


def read_posted_log(path: Path) -> PostedLog | None:
    """The log at ``path``; None when there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_READ)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return PostedLog(notes=[f"posted log unreadable ({type(exc).__name__})"])
    return parse_posted_log(data)


def parse_posted_log(data: bytes) -> PostedLog:
    lines = data.split(b"\n")  # the last piece: b"" after a whole line, or a torn one
    stacks: dict[str, list[Any]] = {}
    entries: dict[int, dict[str, Any]] = {}
    gaps: list[tuple[int, int]] = []
    status: dict[str, Any] = {}
    end: str | None = None
    bad = 0
    for i, line in enumerate(lines):
        rec = _record(line)
        kind = rec.get("kind") if rec is not None else None
        if rec is None or not isinstance(kind, str):
            bad += i < len(lines) - 1 and line.strip() != b""  # a torn last line is expected
            continue
        if kind == "stack":
            if isinstance(rec.get("id"), str) and isinstance(rec.get("frames"), list):
                stacks[rec["id"]] = rec["frames"]  # ids are content hashes: file-wide
        elif kind == "start":  # a new process (or a reset recorder): its ids start over
            entries, gaps, status, end = {}, [], {}, None
        elif kind == "entry":
            if _is_entry(rec):
                entries[rec["record_id"]] = rec
            else:
                bad += 1
        elif kind == "gap":
            lo, hi = rec.get("from"), rec.get("to")
            if isinstance(lo, int) and isinstance(hi, int) and lo <= hi:
                gaps.append((lo, hi))
        elif kind == "status" and isinstance(rec.get("pg"), dict):
            status = rec["pg"]
        elif kind == "end" and end is None:  # the first says how (an exception, then exit)
            end = str(rec.get("reason") or "?")
    out = PostedLog(gaps=sorted(set(gaps)), end=end)
    if bad:
        out.notes.append(f"{bad} unreadable line(s) in its posted log")
    if entries:
        try:
            dump = parse_dump({"entries": [_as_entry(e, stacks)
                                           for _, e in sorted(entries.items())],
                               "pg_status": _pg_status(status)})
        except Exception as exc:  # a reader never takes the analysis down: said, skipped
            out.notes.append(f"posted log entries unreadable ({type(exc).__name__})")
            return out
        out.collectives, out.p2p, out.status = dump.entries, dump.p2p, dump.pg_status
        out.op_lead, out.pg_names = dump.op_lead, dump.pg_names
        for c in out.collectives:
            c.source = "posted_log"
    return out


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # (a line nested past the parser's depth)
        return None
    return rec if isinstance(rec, dict) else None


def _is_entry(rec: dict[str, Any]) -> bool:
    """What the dump parser needs of an entry, of the right types."""
    return (isinstance(rec.get("record_id"), int) and isinstance(rec.get("pg_id"), (int, str))
            and isinstance(rec.get("collective_seq_id"), int)
            and isinstance(rec.get("is_p2p", False), bool))


def _as_entry(rec: dict[str, Any], stacks: dict[str, list[Any]]) -> dict[str, Any]:
    e = dict(rec)
    e.setdefault("is_p2p", False)
    pg = e.get("process_group")
    e["process_group"] = tuple(pg) if isinstance(pg, list) else pg
    sid = e.pop("stack", None)
    if isinstance(sid, str) and sid in stacks:
        e["frames"] = stacks[sid]  # shared: the parser converts each stack once
    return e


def _pg_status(status: dict[str, Any]) -> dict[str, Any]:
    """The last ``status`` record as a dump's ``pg_status`` (keyed by pg_id, as there)."""
    out = {}
    for pg, v in status.items():
        if isinstance(v, list) and len(v) >= 2 and all(isinstance(x, int) for x in v[:3]):
            out[pg] = {"last_enqueued_collective": v[0], "last_completed_collective": v[1],
                       "last_started_collective": v[2] if len(v) > 2 else -1}
    return out


def tail(data: bytes, max_bytes: int) -> bytes:
    """The log cut to about its newest ``max_bytes``, as the probe's own trim cuts its file:
    the last ``start`` record, every ``stack`` record a kept entry uses, the ``gap`` and last
    ``status`` records before the cut, a ``gap`` for the record ids left out, then whole lines
    of the newest part. The log itself where it is no larger (or holds nothing to cut)."""
    if len(data) <= max_bytes:
        return data
    lines = data.split(b"\n")
    recs = [_record(x) for x in lines]
    kinds = [r.get("kind") if r is not None else None for r in recs]
    start = max((i for i, k in enumerate(kinds) if k == "start"), default=-1)
    cut, size = len(lines), 0
    while cut - 1 > start and size + len(lines[cut - 1]) + 1 <= max_bytes:
        cut -= 1
        size += len(lines[cut]) + 1
    dropped = [r["record_id"] for r, k in zip(recs[start + 1:cut], kinds[start + 1:cut],
                                               strict=True)
               if k == "entry" and r is not None and isinstance(r.get("record_id"), int)]
    kept = [r for r, k in zip(recs[cut:], kinds[cut:], strict=True) if k == "entry" and r]
    uses = {r.get("stack") for r in kept}
    head = [lines[start]] if start >= 0 else []
    seen: set[str] = set()
    for line, r, k in zip(lines[:cut], recs[:cut], kinds[:cut], strict=True):
        if k == "stack" and r is not None and r.get("id") in uses and r["id"] not in seen:
            seen.add(r["id"])
            head.append(line)
    head += [lines[i] for i in range(start + 1, cut) if kinds[i] == "gap"]
    status = max((i for i in range(start + 1, cut) if kinds[i] == "status"), default=None)
    if status is not None:
        head.append(lines[status])
    first = next((r["record_id"] for r in kept if isinstance(r.get("record_id"), int)), None)
    if dropped and first is not None and first > min(dropped):
        head.append(json.dumps({"kind": "gap", "from": min(dropped), "to": first - 1,
                                "why": "trimmed"}, separators=(",", ":")).encode())
    return b"\n".join([*head, *lines[cut:]])
