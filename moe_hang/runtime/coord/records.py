"""The protocol's other records: a node's registration (:class:`NodeInfo`), the capture
request, the global verdict, and what one round came to (:class:`RoundResult`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_hang.runtime.coord.codec import SCHEMA, _int_or_none, decode
from moe_hang.runtime.coord.summary import NodeSummary


@dataclass
class NodeInfo:
    node: str
    host: str
    local_ranks: list[int]
    watcher_pid: int
    time: float
    hosts_store: bool = False
    world: int | None = None
    local_world: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "local_ranks": self.local_ranks,
                "watcher_pid": self.watcher_pid, "time": round(self.time, 3),
                "hosts_store": self.hosts_store, "world": self.world,
                "local_world": self.local_world}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeInfo:
        return cls(node=str(d["node"]), host=str(d.get("host", "?")),
                   local_ranks=[int(r) for r in d.get("local_ranks") or []],
                   watcher_pid=int(d.get("watcher_pid") or 0), time=float(d.get("time") or 0.0),
                   hosts_store=bool(d.get("hosts_store")), world=_int_or_none(d.get("world")),
                   local_world=_int_or_none(d.get("local_world")))


@dataclass
class CaptureRequest:
    id: str
    reason: str
    by_node: str
    host: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "by_node": self.by_node,
                "host": self.host, "time": round(self.time, 6)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CaptureRequest:
        return cls(id=str(d["id"]), reason=str(d.get("reason", "")),
                   by_node=str(d.get("by_node", "?")), host=str(d.get("host", "?")),
                   time=float(d.get("time") or 0.0))


@dataclass
class GlobalVerdict:
    """The one verdict every node prints, and the (compact) global set it came from.

    In the channel the record is small (``verdict``: first writer wins); the verdict itself (a
    diagnosis: on 1000 ranks a megabyte of JSON) and the global set travel beside it
    (``verdict-body/<analyst>``, ``global/<analyst>``, written before the record,
    compressed). A reader fetches all three and decodes the diagnosis when :attr:`verdict` is
    used and the set when :attr:`summaries` is: on 1000 nodes, every node parsing them at the
    same moment would be most of the cost."""

    request: str
    by_node: str
    time: float
    verdict_data: dict[str, Any] | None
    captured: list[str]
    missing: list[str]
    hosts: dict[str, str]
    unknown_ranks: list[int]
    local_only: bool = False
    note: str | None = None
    global_raw: bytes | None = field(default=None, repr=False)  # encoded summaries
    _summaries: dict[str, NodeSummary] | None = field(default=None, repr=False)
    verdict_raw: bytes | None = field(default=None, repr=False)  # the encoded diagnosis

    @property
    def verdict(self) -> dict[str, Any]:
        """The diagnosis (``Diagnosis.to_dict``), decoded on first use."""
        if self.verdict_data is None:
            got = decode(self.verdict_raw)
            self.verdict_data = dict(got) if isinstance(got, Mapping) else {}
        return self.verdict_data

    @property
    def summaries(self) -> dict[str, NodeSummary]:
        if self._summaries is None:
            self._summaries = _summaries_from_json(decode(self.global_raw))
        return self._summaries

    def record_json(self) -> dict[str, Any]:
        """What the ``verdict`` key holds: everything but the diagnosis and the global set."""
        d = {"schema": SCHEMA, "request": self.request, "by_node": self.by_node,
             "time": round(self.time, 6), "captured": self.captured,
             "missing": self.missing, "hosts": self.hosts, "unknown_ranks": self.unknown_ranks,
             "local_only": self.local_only}
        if self.note:
            d["note"] = self.note
        return d

    def head_json(self) -> dict[str, Any]:
        """Everything but the global set."""
        return self.record_json() | {"verdict": self.verdict}

    def to_json(self) -> dict[str, Any]:
        """Everything, the global set included (for the run directory)."""
        return self.head_json() | {
            "summaries": {n: s.to_json(stacks=False) for n, s in self.summaries.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], global_raw: bytes | None = None,
                  verdict_raw: bytes | None = None) -> GlobalVerdict:
        body = d.get("verdict")
        v = cls(request=str(d.get("request", "")), by_node=str(d.get("by_node", "?")),
                time=float(d.get("time") or 0.0),
                verdict_data=dict(body) if isinstance(body, Mapping) else None,
                verdict_raw=verdict_raw,
                captured=[str(n) for n in d.get("captured") or []],
                missing=[str(n) for n in d.get("missing") or []],
                hosts={str(k): str(v) for k, v in (d.get("hosts") or {}).items()},
                unknown_ranks=[int(r) for r in d.get("unknown_ranks") or []],
                local_only=bool(d.get("local_only")),
                note=None if d.get("note") is None else str(d["note"]), global_raw=global_raw)
        if "summaries" in d:
            v._summaries = _summaries_from_json(d["summaries"])
        return v


def _summaries_from_json(d: Any) -> dict[str, NodeSummary]:
    out: dict[str, NodeSummary] = {}
    for n, s in (d.items() if isinstance(d, Mapping) else ()):
        with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
            out[str(n)] = NodeSummary.from_json(s)
    return out


@dataclass
class RoundResult:
    verdict: GlobalVerdict
    request: CaptureRequest
    captured: dict[str, NodeSummary]
    missing: list[str]
    analysed_here: bool
    # monotonic seconds from seeing the request: captured (here), all captured, verdict known,
    # acks awaited (store host only)
    timings: dict[str, float] = field(default_factory=dict)
    not_ended: list[str] = field(default_factory=list)
