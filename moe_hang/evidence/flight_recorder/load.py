"""Read one Flight Recorder dump: torch's pickle and JSON, NCCL and gloo, every format torch
2.4 … 2.13 writes ("2.1", "2.4", "2.9", "2.10"; docs/flight_recorder_formats.md) — pure.

``torchfrtrace`` (torch 2.13) crashes on gloo dumps (``KeyError: ('0', 0)``: gloo's
``pg_config`` is keyed ``''``); this reader relies only on the per-entry fields every backend
writes (``process_group``, ``collective_seq_id``, ``p2p_seq_id``, ``profiling_name``, sizes,
dtypes, ``state``/``retired``) and reads ``pg_config``/``pg_status`` where they mean something.

What differs by backend, and why it matters here:

* completion: NCCL marks an entry ``completed`` (and ``pg_status`` counts collectives exactly);
  gloo leaves every entry ``scheduled``, marks only ``retired``, and its ``pg_status`` counts
  *ops* (p2p ops too) and may lag — so gloo's status is translated into sequence numbers
  through the entries' ``op_id``;
* point-to-point: NCCL records ``nccl:send 3->5`` / ``nccl:recv 5<-3`` with *group-local*
  ranks (mapped to global ranks through ``pg_config``); gloo records none;
* coalesced collectives share one ``collective_seq_id`` and end with a ``*_coalesced`` entry:
  they become one :class:`Collective`.

``context`` windows a dump to what a verdict needs: every pending entry and the last
``context`` completed ones per group (and as many p2p ones); the older history is skipped before
any record is built, and frames are converted only for the entries kept (once per distinct
stack: the pickle shares frame objects between entries).

Pickles are read with an unpickler that refuses every global, so a dump from someone else's
directory cannot run code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import IO, Any

from moe_hang.evidence.flight_recorder.parse import parse_dump
from moe_hang.evidence.flight_recorder.parse_entry import RankLists
from moe_hang.evidence.flight_recorder.records import DumpError, FRDump


class RefusedGlobal(DumpError, pickle.UnpicklingError):
    """A pickle that names a Python global: loading it could run code, and torch's dumps
    never hold one."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name} in a Flight Recorder dump")


def _decode(head: bytes, read: IO[bytes]) -> Any:
    if head.lstrip()[:1] == b"{":
        try:
            return json.loads(read.read())
        except UnicodeDecodeError as exc:
            raise DumpError(f"not UTF-8 JSON ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise DumpError(f"truncated or corrupt JSON ({exc.msg} at byte {exc.pos})") from None
    if head[:1] != b"\x80":
        raise DumpError("not a Flight Recorder dump (neither torch's pickle nor JSON)")
    try:
        return _NoGlobals(read).load()
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        if "refusing global" in msg:
            raise RefusedGlobal(f"refused: {msg} (torch's dumps hold none)") from None
        raise DumpError(f"truncated or corrupt pickle ({msg})") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, MemoryError,
            RecursionError, OverflowError) as exc:
        raise DumpError(f"truncated or corrupt pickle ({type(exc).__name__}: {exc})"[:200]) \
            from None


def _checked(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or not ({"version", "entries", "pg_config"} & set(data)):
        raise DumpError("not a Flight Recorder dump (no version, pg_config or entries)")
    return data


def loads(raw: bytes, *, context: int | None = None) -> FRDump:
    """Parse a dump from bytes: JSON when it looks like JSON, else torch's pickle."""
    return parse_dump(_checked(_decode(raw[:64], io.BytesIO(raw))), context=context)


def load_raw(path: Path) -> dict[str, Any]:
    """One dump file as torch wrote it (checked to be one, not parsed): what a node ships of
    it to the node that analyses, as JSON (torch's own JSON layout)."""
    with open(path, "rb") as f:
        return _checked(_decode(f.peek(64)[:64], f))


def load(path: Path, *, context: int | None = None, lists: RankLists | None = None) -> FRDump:
    """One dump file (:class:`DumpError` when it is not one; OSError when unreadable);
    ``lists``: shared with the other files of the same load (:func:`parse_dump`)."""
    with open(path, "rb") as f:
        head = f.peek(64)[:64]  # buffered: no second read of the start
        dump = parse_dump(_checked(_decode(head, f)), context=context, lists=lists)
    dump.source = path
    return dump


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
        except (OSError, DumpError) as exc:  # truncated, corrupt, not a dump: say so, go on
            errors[p.name] = str(exc)[:200]
    return dumps, errors
