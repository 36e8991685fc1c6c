"""What a rank's probe writes of it, parsed (pure data): its heartbeat (``ranks/rank{R}.hb.json``:
progress, the recorder's counts, its main thread's frame, the send/recv it is in) and the
records a worker logs before it posts a collective (``ranks/rank{R}.tokens.jsonl``). Every
reader tolerates a field that is missing or of the wrong type (a rank may die mid-write).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moe_hang.evidence.calls import P2PCall
from moe_hang.evidence.flight_recorder import PgStatus
from moe_hang.evidence.stacks import Frame, parse_probe_frames


def as_int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def as_float(v: Any) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def parse_pg_status(data: Any) -> dict[str, PgStatus] | None:
    """``{pg: {"enqueued": n, "completed": m, "started": k}}`` (the probe's form; ``started``
    only from probes that report it) -> typed; None if absent."""
    if not isinstance(data, dict):
        return None
    out: dict[str, PgStatus] = {}
    for pg, st in data.items():
        if not isinstance(st, dict):
            continue
        e, c = as_int(st.get("enqueued")), as_int(st.get("completed"))
        started = as_int(st.get("started"))
        if e is not None and c is not None:
            out[str(pg)] = PgStatus(e, c, -1 if started is None else started)
    return out


@dataclass
class Heartbeat:
    """One beat of a rank's probe (``ranks/rank{R}.hb.json``)."""

    rank: int
    pid: int | None = None
    host: str | None = None
    world: int | None = None
    local_rank: int | None = None
    local_world: int | None = None
    time: float | None = None
    beat: int = 0
    cpu_s: float | None = None
    progress: dict[str, Any] = field(default_factory=dict)  # what the job reported
    pg_status: dict[str, PgStatus] | None = None  # by process-group id; None: no recorder yet
    pending: list[dict[str, Any]] = field(default_factory=list)  # recorder entries, raw
    main_frame: list[list[Any]] | None = None  # the main thread, innermost first
    # the main thread's id (its pthread id, as the recorder writes a posting thread's): a
    # collective another thread posted is not placed by ``main_frame``
    main_thread: str | None = None
    p2p: P2PCall | None = None  # the send/recv the main thread was inside, with its peer
    restart: int | None = None  # torchrun's restart count of the worker group (0: first)
    held: bool = False  # it raised, and its probe holds it for the capture (multi-node watch)

    @classmethod
    def parse(cls, data: Any) -> Heartbeat | None:
        if not isinstance(data, dict) or as_int(data.get("rank")) is None:
            return None
        progress = data.get("progress")
        pending = data.get("pending")
        frames = data.get("main_frame")
        return cls(
            rank=int(data["rank"]), pid=as_int(data.get("pid")),
            host=str(data["host"]) if data.get("host") else None,
            world=as_int(data.get("world")), local_rank=as_int(data.get("local_rank")),
            local_world=as_int(data.get("local_world")), time=as_float(data.get("time")),
            beat=as_int(data.get("beat")) or 0, cpu_s=as_float(data.get("cpu_s")),
            progress=dict(progress) if isinstance(progress, dict) else {},
            pg_status=parse_pg_status(data.get("pg_status")),
            pending=[e for e in pending if isinstance(e, dict)] if isinstance(pending, list)
            else [],
            main_frame=list(frames) if isinstance(frames, list) else None,
            main_thread=str(data["main_thread"])[:40] if data.get("main_thread") else None,
            p2p=parse_p2p(data.get("p2p")), restart=as_int(data.get("restart")),
            held=data.get("held") is True)

    @property
    def phase(self) -> str | None:
        p = self.progress.get("phase")
        return str(p) if p is not None else None

    @property
    def backend(self) -> str | None:
        b = self.progress.get("backend")
        return str(b) if b is not None else None

    @property
    def said_exiting(self) -> bool:
        """The rank's interpreter was shutting down normally (the probe's last beat at exit;
        an abort or a SIGKILL never gets there)."""
        return self.phase == "exiting"

    def has_pending(self) -> bool:
        """The recorder says some group has a collective posted and not completed."""
        return any(s.pending for s in (self.pg_status or {}).values())

    def frames(self) -> list[Frame]:
        return parse_probe_frames(self.main_frame)

    def fingerprint(self) -> str:
        """What changes while a rank makes progress: its reported progress, the recorder's
        sequence numbers and its main thread's frame."""
        status = None if self.pg_status is None else {
            pg: {"enqueued": s.enqueued, "completed": s.completed}
            for pg, s in self.pg_status.items()}
        return json.dumps([self.progress, status, self.main_frame], sort_keys=True, default=str)


def parse_p2p(d: Any) -> P2PCall | None:
    """The send/recv the probe sampled a thread inside (its ``p2p`` record); None for
    anything else."""
    if not isinstance(d, dict) or d.get("op") not in ("send", "recv"):
        return None
    return P2PCall(str(d["op"]), as_int(d.get("peer")), as_int(d.get("tag")),
                   str(d["group"]) if d.get("group") else None)


def said_exiting(hb: Heartbeat | None) -> bool:
    return hb is not None and hb.said_exiting


@dataclass
class PostedRecord:
    """A collective as the repro worker logged it *before* posting it
    (``ranks/rank{R}.tokens.jsonl``): what it is about to send, and why."""

    seq: int
    op: str
    pg: str
    pg_desc: str = ""
    name: str | None = None  # the step: gather_tokens, combine, ...
    phase: str | None = None  # forward | backward
    tag: str | None = None  # which logical collective (layer1.expert2)
    autograd_fn: str | None = None
    input_sizes: list[list[int]] = field(default_factory=list)
    dtype: str | None = None
    time: float | None = None
    frames: list[Frame] = field(default_factory=list)
    step: int | None = None
    layer: int | None = None
    tokens: dict[str, Any] | None = None  # {"local": n, "per_expert": [...]}
    lengths: list[int] | None = None  # what the varlen exchange gathered
    assumed_lengths: list[int] | None = None  # what DTensor.from_local(Shard(0)) assumes

    @classmethod
    def parse(cls, rec: Any, default_pg: str) -> PostedRecord | None:
        if not isinstance(rec, dict):
            return None
        seq = as_int(rec.get("seq"))
        if seq is None:
            return None
        try:
            sizes = [list(map(int, s)) for s in rec.get("input_sizes") or []]
        except (TypeError, ValueError):
            sizes = []

        def opt(key: str) -> str | None:
            v = rec.get(key)
            return str(v) if v else None

        def ints(key: str) -> list[int] | None:
            v = rec.get(key)
            try:
                return [int(x) for x in v] if isinstance(v, list) else None
            except (TypeError, ValueError):
                return None

        tokens = rec.get("tokens")
        return cls(seq=seq, op=str(rec.get("op", "?")), pg=str(rec.get("pg", default_pg)),
                   pg_desc=str(rec.get("pg_desc", "")), name=opt("name"), phase=opt("phase"),
                   tag=opt("tag"), autograd_fn=opt("autograd_fn"), input_sizes=sizes,
                   dtype=opt("dtype"), time=as_float(rec.get("time")),
                   frames=parse_probe_frames(rec.get("frames")), step=as_int(rec.get("step")),
                   layer=as_int(rec.get("layer")),
                   tokens=dict(tokens) if isinstance(tokens, dict) else None,
                   lengths=ints("lengths"), assumed_lengths=ints("assumed_lengths"))
