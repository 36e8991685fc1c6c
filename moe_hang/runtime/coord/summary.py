"""What one node publishes of its ranks: :class:`NodeSummary` of :class:`RankSummary` s and
their :class:`PendingCollective` s."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_hang.evidence.probe_records import parse_p2p
from moe_hang.evidence.vocab import RankState
from moe_hang.runtime.coord.codec import SCHEMA, _int_or_none, decode, encode


def _sizes(v: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for s in v or []:
        try:
            out.append([int(x) for x in s])
        except (TypeError, ValueError):
            out.append([])
    return out


@dataclass
class PendingCollective:
    """A collective a rank posted that has not completed (its heartbeat's pending entries,
    from its Flight Recorder)."""

    op: str  # the recorder's profiling name, e.g. "nccl:all_gather"
    seq: int
    pg_id: str = "0"
    pg: str | None = None  # group name
    pg_desc: str | None = None
    input_sizes: list[list[int]] = field(default_factory=list)
    output_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    t_ns: int | None = None  # time created

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "seq": self.seq, "pg_id": self.pg_id}
        for k in ("pg", "pg_desc", "t_ns"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        for k in ("input_sizes", "output_sizes", "dtypes"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PendingCollective:
        return cls(op=str(d.get("op", "?")), seq=int(d.get("seq", -1)),
                   pg_id=str(d.get("pg_id", "0")),
                   pg=None if d.get("pg") is None else str(d["pg"]),
                   pg_desc=None if d.get("pg_desc") is None else str(d["pg_desc"]),
                   input_sizes=_sizes(d.get("input_sizes")),
                   output_sizes=_sizes(d.get("output_sizes")),
                   dtypes=[str(x) for x in d.get("dtypes") or []], t_ns=_int_or_none(d.get("t_ns")))

    @classmethod
    def from_fr_entry(cls, e: Mapping[str, Any]) -> PendingCollective | None:
        """From a probe heartbeat's ``pending`` entry (the recorder's entry format)."""
        try:
            seq = int(e.get("collective_seq_id", -1))
        except (TypeError, ValueError):
            return None
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else None
        desc = str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else None
        return cls(op=str(e.get("profiling_name", "?")), seq=seq, pg_id=str(e.get("pg_id", "0")),
                   pg=name, pg_desc=desc, input_sizes=_sizes(e.get("input_sizes")),
                   output_sizes=_sizes(e.get("output_sizes")),
                   dtypes=[str(x) for x in e.get("input_dtypes") or []],
                   t_ns=_int_or_none(e.get("time_created_ns")))

    def to_fr_entry(self) -> dict[str, Any]:
        return {"pg_id": self.pg_id, "process_group": [self.pg or self.pg_id, self.pg_desc or ""],
                "collective_seq_id": self.seq, "profiling_name": self.op,
                "input_sizes": self.input_sizes, "output_sizes": self.output_sizes,
                "input_dtypes": self.dtypes, "time_created_ns": self.t_ns}

    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
        op = self.op.rsplit(":", 1)[-1]
        return op, tuple(tuple(s) for s in self.input_sizes), tuple(self.dtypes)


def _groups(v: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, rs in (v.items() if isinstance(v, Mapping) else ()):
        with contextlib.suppress(TypeError, ValueError):
            out[str(k)] = sorted(int(r) for r in rs)
    return out


@dataclass
class RankSummary:
    rank: int
    pid: int | None = None
    local_rank: int | None = None
    # in_collective | computing | idle | running (moving unknown) | exited | unknown
    state: RankState = RankState.UNKNOWN
    pending: list[PendingCollective] = field(default_factory=list)
    enqueued: dict[str, int] = field(default_factory=dict)  # pg id -> last posted seq
    completed: dict[str, int] = field(default_factory=dict)  # pg id -> last completed seq
    callsite: str | None = None  # "file:line:function", the user line
    stack: list[str] = field(default_factory=list)  # main thread, innermost first
    step: int | None = None
    phase: str | None = None
    moving: bool | None = None
    beat_time: float | None = None
    exit_code: int | None = None
    held: bool = False  # it raised and its probe holds it for the capture
    # the send/recv its main thread is inside, with its peer, as its probe sampled it
    # (op, peer, tag, group): gloo's recorder has no entry for point-to-point
    p2p: dict[str, Any] | None = None
    main_thread: str | None = None  # the id of the thread ``stack`` is (its probe's beat)

    def to_json(self, stacks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "state": self.state}
        for k in ("pid", "local_rank", "callsite", "step", "phase", "moving", "exit_code",
                  "main_thread"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.beat_time is not None:
            d["beat_time"] = round(self.beat_time, 3)
        if self.pending:
            d["pending"] = [p.to_json() for p in self.pending]
        if self.enqueued:
            d["enqueued"] = self.enqueued
        if self.completed:
            d["completed"] = self.completed
        if stacks and self.stack:
            d["stack"] = self.stack
        if self.held:
            d["held"] = True
        if self.p2p:
            d["p2p"] = self.p2p
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankSummary:
        def seqs(v: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            for k, s in (v or {}).items():
                i = _int_or_none(s)
                if i is not None:
                    out[str(k)] = i
            return out

        beat = d.get("beat_time")
        return cls(rank=int(d["rank"]), pid=_int_or_none(d.get("pid")),
                   local_rank=_int_or_none(d.get("local_rank")),
                   state=RankState.parse(d.get("state")),
                   pending=[PendingCollective.from_json(p) for p in d.get("pending") or []
                            if isinstance(p, Mapping)],
                   enqueued=seqs(d.get("enqueued")), completed=seqs(d.get("completed")),
                   callsite=None if d.get("callsite") is None else str(d["callsite"]),
                   stack=[str(s) for s in d.get("stack") or []], step=_int_or_none(d.get("step")),
                   phase=None if d.get("phase") is None else str(d["phase"]),
                   moving=None if d.get("moving") is None else bool(d["moving"]),
                   beat_time=float(beat) if isinstance(beat, (int, float)) else None,
                   exit_code=_int_or_none(d.get("exit_code")),
                   held=d.get("held") is True, p2p=p2p_of(d.get("p2p")),
                   main_thread=str(d["main_thread"])[:40] if d.get("main_thread") else None)


@dataclass
class NodeSummary:
    """What one node's watcher knows about its ranks, compact enough for the store."""

    node: str
    host: str
    ranks: list[RankSummary] = field(default_factory=list)
    world: int | None = None
    local_world: int | None = None
    time: float = 0.0
    watcher_pid: int | None = None
    kind: str = "periodic"  # periodic | capture
    request: str | None = None  # the capture request this answers
    note: str | None = None
    # process group name -> global member ranks, as this node's ranks know them (a capture
    # reads them from the probes' dumps): a rank only knows the groups it is a member of
    groups: dict[str, list[int]] = field(default_factory=dict)
    # a capture only: the node's capture itself, its run directory's files
    # (moe_hang.capture.bundle); with ``stacks`` only (not in the global set every node reads)
    capture: dict[str, Any] | None = None

    def to_json(self, stacks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"schema": SCHEMA, "node": self.node, "host": self.host,
                             "time": round(self.time, 3), "kind": self.kind,
                             "ranks": [r.to_json(stacks) for r in self.ranks]}
        for k in ("world", "local_world", "watcher_pid", "request", "note"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.groups:
            d["groups"] = self.groups
        if stacks and self.capture is not None:
            d["capture"] = self.capture
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeSummary:
        ranks = []
        for r in d.get("ranks") or []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                ranks.append(RankSummary.from_json(r))
        return cls(node=str(d["node"]), host=str(d.get("host", "?")), ranks=ranks,
                   world=_int_or_none(d.get("world")),
                   local_world=_int_or_none(d.get("local_world")),
                   time=float(d.get("time") or 0.0),
                   watcher_pid=_int_or_none(d.get("watcher_pid")),
                   kind=str(d.get("kind", "periodic")),
                   request=None if d.get("request") is None else str(d["request"]),
                   note=None if d.get("note") is None else str(d["note"]),
                   groups=_groups(d.get("groups")),
                   capture=d["capture"] if isinstance(d.get("capture"), dict) else None)

    def encode(self, stacks: bool = True) -> bytes:
        return encode(self.to_json(stacks))

    @classmethod
    def decode(cls, data: bytes | None) -> NodeSummary | None:
        d = decode(data)
        if not isinstance(d, Mapping):
            return None
        try:
            return cls.from_json(d)
        except (KeyError, TypeError, ValueError):
            return None


def p2p_of(v: Any) -> dict[str, Any] | None:
    """A point-to-point call as the probe writes it, checked (evidence.model.parse_p2p), in
    the same form; None for anything else."""
    call = parse_p2p(v)
    return dataclasses.asdict(call) if call is not None else None
