"""Read one Flight Recorder dump: torch's pickle and JSON, NCCL and gloo, every format torch
2.4 … 2.13 writes ("2.1", "2.4", "2.9", "2.10"; /work/notes/fr_formats.md) — pure.

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
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import IO, Any

from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.stacks import Frame, parse_probe_frames

DEFAULT_PG = "0"  # the default process group's name in Flight Recorder and the probe
DEFAULT_CONTEXT = 4  # completed entries kept per group when windowing (history for the verdict)


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
    record_id: int | None = None  # position in the rank's recorder (program order, all groups)
    coalesced: int = 0  # ops merged into this one (a coalesced group); 0: a single op

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # positional: half the unpickling time of the default (workers send thousands)
        return (Collective, _COLLECTIVE_FIELDS(self))


@dataclass
class P2PEntry:
    """One send or recv (NCCL only: gloo records none)."""

    op: str  # send | recv
    peer: int | None  # the other side as a *global* rank (None: not mappable)
    pg: str
    p2p_seq: int  # p2p_seq_id within the group (per rank, +1 per p2p op)
    completed: bool | None
    seq: int = -1  # the group's collective_seq_id at the time (p2p ops do not advance it)
    local_peer: int | None = None  # as recorded, group-local
    pg_desc: str = ""
    input_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    time_created_ns: int | None = None
    record_id: int | None = None
    frames: list[Frame] = field(default_factory=list)
    batched: bool = False  # part of a batch_isend_irecv (closed by nccl:coalesced)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (P2PEntry, _P2P_FIELDS(self))


_COLLECTIVE_FIELDS = attrgetter(*(f.name for f in fields(Collective)))
_P2P_FIELDS = attrgetter(*(f.name for f in fields(P2PEntry)))


@dataclass(frozen=True)
class PgStatus:
    """A process group's last enqueued and last completed sequence number (-1: none)."""

    enqueued: int
    completed: int

    @property
    def pending(self) -> bool:
        return self.enqueued > self.completed


@dataclass
class Window:
    """How much of the dump was kept (``context`` windowing)."""

    total: int  # entries in the dump
    kept: int  # entries turned into records
    first_record_id: int | None = None  # > 0: the ring buffer wrapped (or was reset)


@dataclass
class FRDump:
    entries: list[Collective]  # collectives only, record order
    pg_status: dict[str, PgStatus]  # by process-group name, in collective sequence numbers
    pg_ranks: dict[str, list[int]] = field(default_factory=dict)  # group-local order
    version: str = ""  # the dump's format version ("2.10"), not torch's
    backend: str = ""  # nccl | gloo | ... (from profiling names or the layout)
    source: Path | None = None  # the file it was read from
    p2p: list[P2PEntry] = field(default_factory=list)
    pg_desc: dict[str, str] = field(default_factory=dict)  # group name -> desc
    lib_version: str = ""  # NCCL's version; "" for gloo
    window: Window | None = None

    def by_pg(self) -> dict[str, list[Collective]]:
        out: dict[str, list[Collective]] = {}
        for e in self.entries:
            out.setdefault(e.pg, []).append(e)
        for v in out.values():
            v.sort(key=lambda c: c.seq)
        return out


class DumpError(ValueError):
    """A file that is not a readable Flight Recorder dump (the message says why)."""


class RefusedGlobal(DumpError, pickle.UnpicklingError):
    """A pickle that names a Python global: loading it could run code, and torch's dumps
    never hold one."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing global {module}.{name} in a Flight Recorder dump")


# ----------------------------------------------------------------------------- small parsers


def _sizes(v: Any) -> list[list[int]]:
    try:  # the common case: lists of ints, as every release writes them
        return [[int(x) for x in s] for s in v] if v else []
    except (TypeError, ValueError):
        pass
    out = []
    for s in v:
        try:
            out.append([int(x) for x in s])
        except (TypeError, ValueError):
            continue
    return out


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else default
    except (TypeError, ValueError):
        return default


def _pg_of(e: dict[str, Any]) -> tuple[str, str]:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(e.get("pg_id", DEFAULT_PG)), ""


# (length, head, tail) -> [(the string, its ranks)]: keyed without hashing the whole string
_RANKS_CACHE: dict[tuple[int, str, str], list[tuple[str, list[int]]]] = {}


def parse_ranks(v: Any) -> list[int]:
    """``"[0, 1, 2]"`` (how every release writes ``pg_config`` ranks) or a list -> ints.
    Cached by the string: at 8192 ranks every dump repeats the same 48 KB world list, and
    each load makes a new string object whose full hash would cost more than the compare."""
    if isinstance(v, list):
        return [int(x) for x in v]
    if not isinstance(v, str):
        return []
    key = (len(v), v[:48], v[-48:])
    bucket = _RANKS_CACHE.get(key)
    for text, ranks in bucket or ():
        if text == v:
            return ranks
    try:
        got = json.loads(v)
        ranks = [int(x) for x in got] if isinstance(got, list) else []
    except (ValueError, TypeError):
        ranks = [int(x) for x in re.findall(r"-?\d+", v)]
    if len(_RANKS_CACHE) > 4096:
        _RANKS_CACHE.clear()
    _RANKS_CACHE.setdefault(key, []).append((v, ranks))
    return ranks


# NCCL names the coalesced form of an op after its enum; the shared vocabulary knows the rest
_COALESCED = {"allgather_coalesced": "all_gather", "reduce_scatter_coalesced": "reduce_scatter",
              "allreduce_coalesced": "all_reduce"}
_P2P_NAME = re.compile(r"^(send|recv)\s*(-?\d+)?\s*(->|<-)?\s*(-?\d+)?$")


_OP_CACHE: dict[str, str] = {}


def op_name(profiling_name: str) -> str:
    """``nccl:ALLGATHER_coalesced`` -> ``all_gather``; ``nccl:send 0->1`` -> ``send``."""
    hit = _OP_CACHE.get(profiling_name)
    if hit is None:
        if len(_OP_CACHE) > 65536:
            _OP_CACHE.clear()
        hit = _OP_CACHE[profiling_name] = _op_name(profiling_name)
    return hit


def _op_name(profiling_name: str) -> str:
    tail = profiling_name.rsplit(":", 1)[-1].strip()
    low = tail.lower()
    if low in _COALESCED:
        return _COALESCED[low]
    if low.startswith(("send ", "recv ")):
        return low[:4]
    return normalise_op(profiling_name)


def _p2p_locals(profiling_name: str) -> tuple[int | None, int | None]:
    """(this rank, the peer) as group-local ranks from ``send 3->5`` / ``recv 5<-3``."""
    m = _P2P_NAME.match(profiling_name.rsplit(":", 1)[-1].strip())
    if not m or m.group(2) is None or m.group(4) is None:
        return None, None
    return int(m.group(2)), int(m.group(4))


class _Frames:
    """Frames converted once per distinct recorded stack (the pickle shares frame dicts, and
    often the list, between entries)."""

    def __init__(self) -> None:
        self._by_id: dict[tuple[int, ...], list[Frame]] = {}

    def __call__(self, raw: Any) -> list[Frame]:
        if not raw or not isinstance(raw, list):
            return []
        key = tuple(map(id, raw))
        hit = self._by_id.get(key)
        if hit is None:
            hit = self._by_id[key] = parse_probe_frames(raw)
        return hit


# ----------------------------------------------------------------------------- entries


def entry_to_collective(e: dict[str, Any], source: str = "flight_recorder",
                        frames: _Frames | None = None) -> Collective | None:
    """A collective entry as a record (None for point-to-point and malformed entries)."""
    if e.get("is_p2p"):
        return None
    pg_name, pg_desc = _pg_of(e)
    seq = _int(e.get("collective_seq_id"), -2)
    if seq == -2:
        return None
    raw = str(e.get("profiling_name", ""))
    t_created = e.get("time_created_ns")
    rid = e.get("record_id")
    return Collective(
        pg=pg_name, seq=seq, op=op_name(raw), raw_op=raw, pg_desc=pg_desc,
        input_sizes=_sizes(e.get("input_sizes")), output_sizes=_sizes(e.get("output_sizes")),
        dtypes=[str(d) for d in e.get("input_dtypes") or []],
        time_created_ns=int(t_created) if isinstance(t_created, (int, float)) else None,
        frames=(frames or _Frames())(e.get("frames")),
        completed=True if e.get("state") == "completed" else None, source=source,
        record_id=rid if isinstance(rid, int) else None)


def _p2p_entry(e: dict[str, Any], completed: bool | None, pg_ranks: dict[str, list[int]],
               frames: _Frames) -> P2PEntry | None:
    raw = str(e.get("profiling_name", ""))
    op = op_name(raw)
    if op not in ("send", "recv"):
        return None  # the "nccl:coalesced" that closes a batch
    pg_name, pg_desc = _pg_of(e)
    _me, local_peer = _p2p_locals(raw)
    members = pg_ranks.get(pg_name)
    if local_peer is None:
        peer = None
    elif members and 0 <= local_peer < len(members):
        peer = members[local_peer]
    elif pg_name == DEFAULT_PG:
        peer = local_peer  # the default group's local ranks are the global ones
    else:
        peer = None
    t_created = e.get("time_created_ns")
    rid = e.get("record_id")
    return P2PEntry(op=op, peer=peer, pg=pg_name, p2p_seq=_int(e.get("p2p_seq_id")),
                    completed=completed, seq=_int(e.get("collective_seq_id")),
                    local_peer=local_peer, pg_desc=pg_desc,
                    input_sizes=_sizes(e.get("input_sizes")),
                    dtypes=[str(d) for d in e.get("input_dtypes") or []],
                    time_created_ns=int(t_created) if isinstance(t_created, (int, float))
                    else None, record_id=rid if isinstance(rid, int) else None,
                    frames=frames(e.get("frames")))


def _merge_coalesced(group: list[Collective]) -> Collective:
    """Ops sharing one collective_seq_id (a coalescing manager): one collective whose sizes
    and dtypes are the member ops' in order; the closing ``*_coalesced`` entry names it."""
    closing = [c for c in group if c.raw_op.lower().endswith("coalesced")]
    members = [c for c in group if c not in closing] or group
    head = closing[-1] if closing else members[0]
    ops = {c.op for c in members}
    op = head.op if closing and head.op != "coalesced" else (ops.pop() if len(ops) == 1
                                                              else "coalesced")
    done = [c.completed for c in group]
    return Collective(
        pg=head.pg, seq=head.seq, op=op, raw_op=head.raw_op, pg_desc=head.pg_desc,
        input_sizes=[s for c in members for s in c.input_sizes],
        output_sizes=[s for c in members for s in c.output_sizes],
        dtypes=[d for c in members for d in c.dtypes],
        time_created_ns=members[0].time_created_ns, frames=members[0].frames,
        completed=True if all(d is True for d in done) else
        (False if any(d is False for d in done) else None),
        record_id=members[0].record_id, coalesced=len(members))


# ----------------------------------------------------------------------------- a whole dump


def detect_backend(data: dict[str, Any], raw_entries: list[Any]) -> str:
    for e in reversed(raw_entries):
        if isinstance(e, dict):
            name = str(e.get("profiling_name", ""))
            if ":" in name:
                return name.split(":", 1)[0]
    cfg = data.get("pg_config")
    if isinstance(cfg, dict) and "" in cfg:
        return "gloo"  # gloo's groups all land on one ("", "") key (fr_formats.md §4)
    lib = data.get("comm_lib_version", data.get("nccl_version"))
    if isinstance(lib, str):
        return "nccl" if lib else "gloo"
    return ""


def _pg_ranks(data: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, str]]:
    ranks: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    cfg = data.get("pg_config")
    for key, c in (cfg.items() if isinstance(cfg, dict) else ()):
        if not key or not isinstance(c, dict):
            continue  # gloo keys its only entry "" with no useful name
        members = parse_ranks(c.get("ranks"))
        if members:
            ranks[str(key)] = members
        if c.get("desc"):
            descs[str(key)] = str(c["desc"])
    return ranks, descs


@dataclass
class _Selection:
    keep: list[tuple[dict[str, Any], bool | None]]  # (entry, completed), oldest first
    newest: dict[Any, dict[str, Any]]  # pg_id -> its newest entry (names the group)
    top_seq: dict[Any, int]  # pg_id -> highest collective seq recorded
    top_done: dict[Any, int]  # pg_id -> highest collective seq known completed
    op_seq: dict[str, int]  # gloo: pg_id -> seq of the op pg_status calls last completed
    first_record_id: int | None


def _select(raw: list[Any], gloo: bool, status_raw: dict[str, Any],
            context: int | None) -> _Selection:
    """Pass 1, newest entry first, a few dict lookups each (this loop runs for every entry
    of every rank, so nothing is built here): completion, per-group facts, the window."""
    nccl_done: dict[Any, int] = {}  # NCCL's pg_status counts collectives: at or below is done
    gloo_op: dict[Any, int] = {}  # gloo's counts ops: find the entry with that op id
    for k, st in status_raw.items():
        if isinstance(st, dict):
            key = _int(k, -9)
            (gloo_op if gloo else nccl_done)[key] = _int(st.get("last_completed_collective"))
    keep: list[tuple[dict[str, Any], bool | None]] = []
    counts: dict[tuple[Any, bool], int] = {}
    newest: dict[Any, dict[str, Any]] = {}
    top_seq: dict[Any, int] = {}
    top_done: dict[Any, int] = {}
    op_seq: dict[str, int] = {}
    unfinished = ("scheduled", "started")
    done: bool | None
    # Every group of the process is in pg_status, and a group's collectives complete in
    # order: once each listed group has its window of completed collectives, older entries
    # can only be completed collectives (skipped) or old p2p ops (below)
    listed = set(nccl_done) | set(gloo_op)
    need = len(listed) if context is not None else 0
    full = 0
    stop = 0
    for i in range(len(raw) - 1, -1, -1):
        e = raw[i]
        try:
            pid, p2p, seq = e["pg_id"], e["is_p2p"], e["collective_seq_id"]
        except (KeyError, TypeError):
            continue  # not an entry of any release: skipped
        if pid not in newest:
            newest[pid] = e
        if gloo:
            done = bool(e.get("retired"))  # gloo's only completion signal
            if not p2p and gloo_op.get(pid) == e.get("op_id"):
                op_seq.setdefault(str(pid), seq)
        else:
            state = e.get("state")
            lim = nccl_done.get(pid)
            if state == "completed":
                done = True
            elif not p2p and lim is not None:
                done = seq <= lim
            else:
                done = False if state in unfinished else None
        if not p2p:
            if pid not in top_seq:
                top_seq[pid] = seq
            if done and pid not in top_done:
                top_done[pid] = seq
        if done and context is not None:
            k2 = (pid, p2p)
            n = counts.get(k2, 0)
            if n >= context:
                continue
            counts[k2] = n + 1
            if n + 1 == context and not p2p and pid in listed:
                full += 1
                if full == need:
                    keep.append((e, done))
                    stop = i
                    break
        keep.append((e, done))
    keep.reverse()
    # a send/recv still pending from before the window (NCCL runs p2p on its own streams, so
    # later collectives may have completed past it); every entry carries its group's
    # p2p_seq_id, so a window whose groups never did p2p has none to look for
    if stop and not gloo and any(e.get("p2p_seq_id") for e, _d in keep):
        older = [(e, False) for e in raw[:stop] if isinstance(e, dict) and e.get("is_p2p")
                 and e.get("state") != "completed"]
        keep[:0] = older
    rid = next((e.get("record_id") for e in raw if isinstance(e, dict)), None)
    return _Selection(keep, newest, top_seq, top_done, op_seq,
                      rid if isinstance(rid, int) else None)


def parse_dump(data: dict[str, Any], *, context: int | None = None) -> FRDump:
    """One dump's mapping -> :class:`FRDump`. ``context``: keep only the pending entries and
    the last ``context`` completed ones per group (None: keep everything)."""
    raw_entries = data.get("entries") or []  # JSON omits "entries" when empty
    if not isinstance(raw_entries, list):
        raise DumpError("'entries' is not a list")
    backend = detect_backend(data, raw_entries)
    gloo = backend == "gloo"
    pg_ranks, descs = _pg_ranks(data)
    status_raw = data.get("pg_status")
    status_raw = status_raw if isinstance(status_raw, dict) else {}
    sel = _select(raw_entries, gloo, status_raw, context)
    id_to_name: dict[str, str] = {}
    for pid, e in sel.newest.items():
        name, desc = _pg_of(e)
        id_to_name[str(pid)] = name
        if desc:
            descs.setdefault(name, desc)
    top_seq = {id_to_name[str(k)]: v for k, v in sel.top_seq.items()}
    top_done = {id_to_name[str(k)]: v for k, v in sel.top_done.items()}
    keep = sel.keep

    # Pass 2: records for what was kept, oldest first
    frames = _Frames()
    colls: list[Collective] = []
    p2ps: list[P2PEntry] = []
    batch_open: list[P2PEntry] = []
    for e, done in keep:
        if e.get("is_p2p"):
            p = _p2p_entry(e, done, pg_ranks, frames)
            if p is None:  # nccl:coalesced closes a batch_isend_irecv
                for b in batch_open:
                    b.batched = True
                batch_open = []
                continue
            if batch_open and (batch_open[-1].pg, batch_open[-1].p2p_seq) != (p.pg, p.p2p_seq):
                batch_open = []
            batch_open.append(p)
            p2ps.append(p)
            continue
        c = entry_to_collective(e, frames=frames)
        if c is None:
            continue
        c.completed = done
        colls.append(c)
    colls = _coalesce(colls)

    status = _status(status_raw, id_to_name, gloo, sel.op_seq, top_seq, top_done)
    for c in colls:
        st = status.get(c.pg)
        if c.completed is None and st is not None and st.completed >= 0:
            c.completed = c.seq <= st.completed
    lib = data.get("comm_lib_version", data.get("nccl_version", ""))
    return FRDump(colls, status, pg_ranks, str(data.get("version", "")), backend, p2p=p2ps,
                  pg_desc=descs, lib_version=str(lib or ""),
                  window=Window(len(raw_entries), len(keep), sel.first_record_id))


def _coalesce(colls: list[Collective]) -> list[Collective]:
    """Adjacent entries of one group with one collective_seq_id are one coalesced op."""
    by_key: dict[tuple[str, int], list[Collective]] = {}
    for c in colls:
        by_key.setdefault((c.pg, c.seq), []).append(c)
    if all(len(v) == 1 for v in by_key.values()):
        return colls
    out: list[Collective] = []
    done: set[tuple[str, int]] = set()
    for c in colls:
        k = (c.pg, c.seq)
        group = by_key[k]
        if len(group) == 1:
            out.append(c)
        elif k not in done:
            done.add(k)
            out.append(_merge_coalesced(group))
    return out


def _status(raw: dict[str, Any], id_to_name: dict[str, str], gloo: bool,
            op_seq: dict[str, int], top_seq: dict[str, int],
            top_done: dict[str, int]) -> dict[str, PgStatus]:
    """pg_status by group *name*, in collective sequence numbers. It is keyed by the local
    pg_id, named only through entries: a group none of whose entries is left is dropped (its
    id is not a group name, and "1" as an id is not group "1")."""
    out: dict[str, PgStatus] = {}
    for pg_id, s in raw.items():
        name = id_to_name.get(str(pg_id))
        if name is None or not isinstance(s, dict):
            continue
        enq = _int(s.get("last_enqueued_collective"))
        comp = _int(s.get("last_completed_collective"))
        if gloo:
            # gloo counts ops, p2p included, and lags: read through op ids, trust `retired`
            comp = max(op_seq.get(str(pg_id), -1), top_done.get(name, -1))
            enq = max(top_seq.get(name, -1), comp)
        else:
            enq = max(enq, top_seq.get(name, -1))
            comp = max(comp, top_done.get(name, -1))
        out[name] = PgStatus(enq, comp)
    for name, top in top_seq.items():  # format "2.1" has no pg_status: from the entries
        if name not in out and not raw:
            out[name] = PgStatus(top, top_done.get(name, -1))
    return out


# ----------------------------------------------------------------------------- bytes and files


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


def load(path: Path, *, context: int | None = None) -> FRDump:
    """One dump file (:class:`DumpError` when it is not one; OSError when unreadable)."""
    with open(path, "rb") as f:
        head = f.peek(64)[:64]  # buffered: no second read of the start
        dump = parse_dump(_checked(_decode(head, f)), context=context)
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
