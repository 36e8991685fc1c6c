"""One Flight Recorder entry at a time (:mod:`.parse` reads whole dumps):
the small field parsers, operation names, frames, and an entry as a :class:`Collective` or a
:class:`P2PEntry` — pure."""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from typing import Any

from moe_hang.evidence.flight_recorder.records import DEFAULT_PG, STATES, Collective, P2PEntry
from moe_hang.evidence.ops import normalise_op
from moe_hang.evidence.stacks import Frame, parse_probe_frames


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


def _time(v: Any) -> int | None:
    """A recorded time in ns; JSON writes a missing one as 0, pickles as None: both None."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _state(v: Any) -> str | None:
    return v if v in STATES else None


def _duration(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _timing(e: dict[str, Any]) -> dict[str, Any]:
    """The entry's state, its two discovered times and its duration (timing only)."""
    return {"state": _state(e.get("state")),
            "time_started_ns": _time(e.get("time_discovered_started_ns")),
            "time_completed_ns": _time(e.get("time_discovered_completed_ns")),
            "duration_ms": _duration(e.get("duration_ms"))}


def _thread(e: dict[str, Any]) -> dict[str, Any]:
    """The posting thread's id and name (torch >= 2.8 records them; None before)."""
    tid, name = e.get("thread_id"), e.get("thread_name")
    return {"thread_id": None if tid is None or tid == "" else str(tid),
            "thread_name": None if name is None or name == "" else str(name)}


def _pg_of(e: dict[str, Any]) -> tuple[str, str]:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(e.get("pg_id", DEFAULT_PG)), ""


class RankLists:
    """What the dumps of one load (a file, a worker's chunk of files, a job's nodes) repeat,
    parsed once and shared, immutable: group member lists and recorded stacks. At 8192 ranks
    every dump repeats the same 48 KB world list: each load makes a new string object whose
    full hash would cost more than the compare, so strings are keyed by (length, head, tail)
    and compared in full only there. A stack is keyed by its content (a JSON dump decodes
    every entry's frames anew), so the entries of every rank that posted from one line share
    one frame list — what the analysis reads once per distinct list. Sizes and dtypes
    likewise (:meth:`sizes`, :meth:`dtypes`): the entries of one collective on every rank
    hold one list each, so a chunk's pipe carries each once and the analysis compares them
    by identity first."""

    def __init__(self) -> None:
        self._by_text: dict[tuple[int, str, str], list[tuple[str, tuple[int, ...]]]] = {}
        self._digests: dict[tuple[int, ...], str] = {}
        self.stacks: dict[tuple[Any, ...], list[Frame]] = {}
        self._shapes: dict[tuple[Any, ...], Any] = {}

    def sizes(self, v: Any) -> list[list[int]]:
        """:func:`_sizes` of ``v``, one list per distinct value (never mutated: records
        share them); keyed by the raw value, so a value seen before is not converted."""
        try:
            key = ("sizes", *map(tuple, v)) if v else ("sizes",)
            hit = self._shapes.get(key)
        except TypeError:  # not lists of numbers: converted on its own
            return _sizes(v)
        if hit is None:
            hit = self._shapes[key] = _sizes(v)
        return hit

    def dtypes(self, v: Any) -> list[str]:
        """The dtypes as strings, shared as :meth:`sizes`."""
        try:
            key = ("dtypes", *v) if v else ("dtypes",)
            hit = self._shapes.get(key)
        except TypeError:
            return [str(d) for d in v]
        if hit is None:
            hit = self._shapes[key] = [str(d) for d in v]
        return hit

    def stack(self, v: list[Frame]) -> list[Frame]:
        """``v``, or the equal stack seen before (the analysis compares stacks of every rank:
        by identity first)."""
        return self.stacks.setdefault(tuple(v), v)

    def parse(self, v: Any) -> tuple[int, ...]:
        if not isinstance(v, str):
            return parse_ranks(v)
        key = (len(v), v[:48], v[-48:])
        bucket = self._by_text.setdefault(key, [])
        for text, ranks in bucket:
            if text == v:
                return ranks
        ranks = parse_ranks(v)
        bucket.append((v, ranks))
        return ranks

    def digest(self, ranks: tuple[int, ...]) -> str:
        """A short name for a list (what crosses a worker's pipe instead of the list)."""
        hit = self._digests.get(ranks)
        if hit is None:
            hit = self._digests[ranks] = hashlib.blake2b(
                array("q", ranks).tobytes(), digest_size=16).hexdigest()
        return hit


def parse_ranks(v: Any) -> tuple[int, ...]:
    """``"[0, 1, 2]"`` (how every release writes ``pg_config`` ranks) or a list -> ints."""
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    if not isinstance(v, str):
        return ()
    try:
        got = json.loads(v)
        return tuple(int(x) for x in got) if isinstance(got, list) else ()
    except (ValueError, TypeError):
        return tuple(int(x) for x in re.findall(r"-?\d+", v))


# NCCL names the coalesced form of an op after its enum; the shared vocabulary knows the rest
_COALESCED = {"allgather_coalesced": "all_gather", "reduce_scatter_coalesced": "reduce_scatter",
              "allreduce_coalesced": "all_reduce"}
_P2P_NAME = re.compile(r"^(send|recv)\s*(-?\d+)?\s*(->|<-)?\s*(-?\d+)?$")


def op_name(profiling_name: str) -> str:
    """``nccl:ALLGATHER_coalesced`` -> ``all_gather``; ``nccl:send 0->1`` -> ``send``."""
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
    often the list, between entries; by content across the load's dumps, ``shared``), and op
    names once per distinct name (a few dozen in a dump of millions of entries). The
    identity memo is for one dump's parse, never kept beyond it (an id is only unique while
    its object lives)."""

    def __init__(self, lists: RankLists | None = None) -> None:
        self._by_id: dict[tuple[int, ...], list[Frame]] = {}
        self._ops: dict[str, str] = {}
        self._lists = lists if lists is not None else RankLists()
        self._shared = self._lists.stacks
        self.sizes = self._lists.sizes
        self.dtypes = self._lists.dtypes

    def op(self, profiling_name: str) -> str:
        hit = self._ops.get(profiling_name)
        if hit is None:
            hit = self._ops[profiling_name] = op_name(profiling_name)
        return hit

    def __call__(self, raw: Any) -> list[Frame]:
        if not raw or not isinstance(raw, list):
            return self._lists.stack([])
        key = tuple(map(id, raw))
        hit = self._by_id.get(key)
        if hit is None:
            hit = self._by_id[key] = self._by_content(raw)
        return hit

    def _by_content(self, raw: list[Any]) -> list[Frame]:
        try:
            key = tuple([tuple(f.items()) if isinstance(f, dict) else tuple(f) for f in raw])
            hit = self._shared.get(key)
        except TypeError:  # a frame of an unhashable shape: parsed on its own
            return parse_probe_frames(raw)
        if hit is None:
            hit = self._shared[key] = parse_probe_frames(raw)
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
    rid = e.get("record_id")
    memo = frames or _Frames()
    return Collective(
        pg=pg_name, seq=seq, op=memo.op(raw), raw_op=raw, pg_desc=pg_desc,
        input_sizes=memo.sizes(e.get("input_sizes")),
        output_sizes=memo.sizes(e.get("output_sizes")), dtypes=memo.dtypes(e.get("input_dtypes")),
        time_created_ns=_time(e.get("time_created_ns")),
        frames=memo(e.get("frames")),
        completed=True if e.get("state") == "completed" else None, source=source,
        record_id=rid if isinstance(rid, int) else None, **_timing(e), **_thread(e))


def _p2p_entry(e: dict[str, Any], completed: bool | None,
               pg_ranks: dict[str, tuple[int, ...]],
               frames: _Frames) -> P2PEntry | None:
    raw = str(e.get("profiling_name", ""))
    op = frames.op(raw)
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
    rid = e.get("record_id")
    return P2PEntry(op=op, peer=peer, pg=pg_name, p2p_seq=_int(e.get("p2p_seq_id")),
                    completed=completed, seq=_int(e.get("collective_seq_id")),
                    local_peer=local_peer, pg_desc=pg_desc,
                    input_sizes=frames.sizes(e.get("input_sizes")),
                    dtypes=frames.dtypes(e.get("input_dtypes")),
                    time_created_ns=_time(e.get("time_created_ns")),
                    record_id=rid if isinstance(rid, int) else None,
                    frames=frames(e.get("frames")), **_timing(e), **_thread(e))


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
    # the whole op is as far as its least advanced member; it started when the last member
    # started, completed when the last completed (a time any member lacks is not known)
    states = [c.state for c in group]
    state = (min(states, key=STATES.index) if all(s is not None for s in states) else None)
    starts = [c.time_started_ns for c in group]
    ends = [c.time_completed_ns for c in group]
    durations = [c.duration_ms for c in group]
    return Collective(
        pg=head.pg, seq=head.seq, op=op, raw_op=head.raw_op, pg_desc=head.pg_desc,
        input_sizes=[s for c in members for s in c.input_sizes],
        output_sizes=[s for c in members for s in c.output_sizes],
        dtypes=[d for c in members for d in c.dtypes],
        time_created_ns=members[0].time_created_ns, frames=members[0].frames,
        completed=True if all(d is True for d in done) else
        (False if any(d is False for d in done) else None),
        record_id=members[0].record_id, coalesced=len(members), state=state,
        time_started_ns=max(t for t in starts if t is not None)
        if all(t is not None for t in starts) else None,
        time_completed_ns=max(t for t in ends if t is not None)
        if all(t is not None for t in ends) else None,
        duration_ms=max(d for d in durations if d is not None)
        if all(d is not None for d in durations) else None,
        thread_id=members[0].thread_id, thread_name=members[0].thread_name)
