"""A whole dump's mapping -> :class:`FRDump` (:func:`parse_dump`): the backend, the groups,
which entries completed, the ``context`` window, coalesced ops and each group's status
(:mod:`.load` describes what differs by backend) — pure.

Completion is decided here; an entry's own ``state`` (scheduled / started / completed), its
discovered times and duration are kept as recorded (:mod:`.parse_entry`): ``started`` appears
only with start events (TORCH_NCCL_ENABLE_TIMING=1), and says the kernel ran, which
``scheduled`` does not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_hang.evidence.flight_recorder.parse_entry import (
    RankLists,
    _Frames,
    _int,
    _merge_coalesced,
    _p2p_entry,
    _pg_of,
    entry_to_collective,
)
from moe_hang.evidence.flight_recorder.records import (
    Collective,
    DumpError,
    FRDump,
    P2PEntry,
    PgStatus,
    Window,
)


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


def _pg_ranks(data: dict[str, Any], lists: RankLists
              ) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    ranks: dict[str, tuple[int, ...]] = {}
    descs: dict[str, str] = {}
    cfg = data.get("pg_config")
    for key, c in (cfg.items() if isinstance(cfg, dict) else ()):
        if not key or not isinstance(c, dict):
            continue  # gloo keys its only entry "" with no useful name
        members = lists.parse(c.get("ranks"))
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
    op_lead: dict[Any, int]  # gloo: pg_id -> its newest collective's op id minus its seq


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
    op_lead: dict[Any, int] = {}
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
                if gloo and isinstance(op := e.get("op_id"), int) and isinstance(seq, int):
                    op_lead[pid] = op - seq
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
                      rid if isinstance(rid, int) else None, op_lead)


def parse_dump(data: dict[str, Any], *, context: int | None = None,
               lists: RankLists | None = None) -> FRDump:
    """One dump's mapping -> :class:`FRDump`. ``context``: keep only the pending entries and
    the last ``context`` completed ones per group (None: keep everything); ``lists``: the
    member lists of the files loaded with this one (shared between their dumps)."""
    raw_entries = data.get("entries") or []  # JSON omits "entries" when empty
    if not isinstance(raw_entries, list):
        raise DumpError("'entries' is not a list")
    backend = detect_backend(data, raw_entries)
    gloo = backend == "gloo"
    lists = lists or RankLists()
    pg_ranks, descs = _pg_ranks(data, lists)
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
    frames = _Frames(lists)
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
                  window=Window(len(raw_entries), len(keep), sel.first_record_id),
                  op_lead={id_to_name[str(k)]: v for k, v in sel.op_lead.items() if v >= 0},
                  pg_names=id_to_name)


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
        started = -1 if gloo else _int(s.get("last_started_collective"))
        if gloo:
            # gloo counts ops, p2p included, and lags: read through op ids, trust `retired`
            comp = max(op_seq.get(str(pg_id), -1), top_done.get(name, -1))
            enq = max(top_seq.get(name, -1), comp)
        else:
            enq = max(enq, top_seq.get(name, -1))
            comp = max(comp, top_done.get(name, -1))
        out[name] = PgStatus(enq, comp, started)
    for name, top in top_seq.items():  # format "2.1" has no pg_status: from the entries
        if name not in out and not raw:
            out[name] = PgStatus(top, top_done.get(name, -1))
    return out
