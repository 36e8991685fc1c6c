"""The first part of :class:`~moe_hang.runtime.coord.Coordinator`: its state, rounds,
registration, liveness beats and summaries."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from moe_hang.runtime.coord.channel import Channel, ChannelGone, sanitize
from moe_hang.runtime.coord.codec import decode, encode
from moe_hang.runtime.coord.records import CaptureRequest, NodeInfo
from moe_hang.runtime.coord.summary import NodeSummary
from moe_hang.runtime.coord.worker import T


class _Membership:
    """State, rounds, membership and summaries of :class:`Coordinator`."""

    def __init__(self, channel: Channel, node: str, host: str | None = None, *,
                 watcher_pid: int | None = None, poll_s: float = 0.05,
                 stale_request_s: float = 120.0) -> None:
        self.channel = channel
        self.node = sanitize(node)
        self.host = host or socket.gethostname()
        self.watcher_pid = os.getpid() if watcher_pid is None else watcher_pid
        self.poll_s = poll_s
        self.t0 = time.time()
        # a request older than this watcher (minus clock skew) belongs to an earlier job that
        # used the same shared directory
        self.stale_request_s = stale_request_s
        self.local_world: int | None = None
        self.hosts_store = False
        self._beats = 0
        self._request: CaptureRequest | None = None
        self.request_event = threading.Event()
        self._offered: NodeSummary | None = None
        self._offered_fp: str | None = None
        self._published_fp: str | None = None
        self._last_pub = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._verdict_seen: float | None = None
        # rounds: a capture that did not end the job (on request, an uncertain verdict) is
        # followed by another one under fresh keys (r<k>/request, ...); round 0 has none
        self.round = 0

    @property
    def gone(self) -> str | None:
        return self.channel.gone

    def _rk(self, name: str, rnd: int | None = None) -> str:
        """A key of the current round (``rnd``: of that one)."""
        k = self.round if rnd is None else rnd
        return name if k == 0 else f"r{k}/{name}"

    def next_round(self) -> int:
        """After a round that did not end the job: the next capture request is a new one.
        Every node moves on once it has the verdict; the round number is also kept in the
        channel, for a watcher that registers later."""
        with self._lock:
            self.round += 1
            self._request = None
            self.request_event.clear()
            rnd = self.round
        self._done(lambda: self.channel.put("round", str(rnd).encode()))
        return rnd

    def _current_round(self) -> None:
        raw = self._try(lambda: self.channel.get("round"), None)
        with contextlib.suppress(ValueError, TypeError):
            rnd = int((raw or b"0").decode())
            with self._lock:
                if rnd > self.round:
                    self.round, self._request = rnd, None
                    self.request_event.clear()

    def _try(self, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except ChannelGone:
            return default

    def _done(self, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except ChannelGone:
            return False

    # ------------------------------------------------------------------ membership

    def register(self, local_ranks: Sequence[int], *, hosts_store: bool = False,
                 world: int | None = None, local_world: int | None = None) -> bool:
        self.hosts_store = hosts_store
        self.local_world = local_world or len(local_ranks) or None
        info = NodeInfo(self.node, self.host, sorted(int(r) for r in local_ranks),
                        self.watcher_pid, time.time(), hosts_store, world, self.local_world)

        self.beat()
        return self._done(lambda: self.channel.put_member("node", self.node,
                                                          encode(info.to_json())))

    def beat(self) -> bool:
        """Liveness: a counter others watch change (no clocks compared across nodes)."""
        self._beats += 1
        data = str(self._beats).encode()
        return self._done(lambda: self.channel.put(f"alive/{self.node}", data))

    def nodes(self) -> dict[str, NodeInfo]:
        def do() -> dict[str, NodeInfo]:
            names = self.channel.members("node")
            out: dict[str, NodeInfo] = {}
            for n, raw in zip(names, self.channel.get_many([f"node/{n}" for n in names]),
                              strict=True):
                d = decode(raw)
                if isinstance(d, Mapping):
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        out[n] = NodeInfo.from_json(d)
            return out

        return self._try(do, {})

    # ------------------------------------------------------------------ summaries

    def publish_summary(self, summary: NodeSummary) -> bool:
        summary.node = self.node
        data = summary.encode()
        return self._done(lambda: self.channel.put_member("summary", self.node, data))

    def offer_summary(self, summary: NodeSummary) -> None:
        """Hand the latest summary to the background thread (published when it changed, at
        most every ``publish_every_s``): the watch loop never waits on the channel."""
        fp = json.dumps([r.to_json(stacks=True) | {"beat_time": None} for r in summary.ranks],
                        sort_keys=True, default=str)
        with self._lock:
            self._offered, self._offered_fp = summary, fp

    def _read_ns(self, ns: str, nodes: Sequence[str] | None) -> dict[str, NodeSummary]:
        if ns == "captured":
            ns = self._rk(ns)
        names = list(nodes) if nodes is not None else self.channel.members(ns)
        out: dict[str, NodeSummary] = {}
        for n, raw in zip(names, self.channel.get_many([f"{ns}/{sanitize(n)}" for n in names]),
                          strict=True):
            s = NodeSummary.decode(raw)
            if s is not None:
                out[n] = s
        return out

    def read_summaries(self, nodes: Sequence[str] | None = None,
                       kind: str = "summary") -> dict[str, NodeSummary]:
        """The latest published summaries (``kind="captured"``: the captures), node -> summary.
        What ``diagnose`` on one node reads about the others."""
        return self._try(lambda: self._read_ns(kind, nodes), {})
