"""The capture and the verdict of :class:`~moe_hang.runtime.coord.Coordinator`: the request
(first one wins), every node's capture, the verdict (first one wins) and the acknowledgements."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from moe_hang.runtime.coord.channel import _node_sort_key, sanitize
from moe_hang.runtime.coord.codec import decode, encode
from moe_hang.runtime.coord.heartbeats import ranks_of_nodes
from moe_hang.runtime.coord.membership import _Membership
from moe_hang.runtime.coord.records import CaptureRequest, GlobalVerdict
from moe_hang.runtime.coord.summary import NodeSummary


class _Exchange(_Membership):
    """Capture requests, captures, the verdict and the acknowledgements of
    :class:`Coordinator`."""

    # ------------------------------------------------------------------ capture

    def _accept(self, raw: bytes | None, rnd: int | None = None) -> CaptureRequest | None:
        """``raw`` read for round ``rnd`` (None: the current one) becomes the request of this
        round, unless the round moved on meanwhile."""
        d = decode(raw)
        if not isinstance(d, Mapping):
            return None
        try:
            req = CaptureRequest.from_json(d)
        except (KeyError, TypeError, ValueError):
            return None
        if req.time < self.t0 - self.stale_request_s:
            return None
        with self._lock:
            if rnd is not None and rnd != self.round:
                return None
            if self._request is None:
                self._request = req
                self.request_event.set()
            return self._request

    def request_capture(self, reason: str, by_node: str | None = None) -> CaptureRequest | None:
        """Ask every node to capture. The first request wins (atomic compare-and-set): the one
        returned may be another node's. None if the channel is gone."""
        me = sanitize(by_node) if by_node else self.node
        now = time.time()
        req = CaptureRequest(f"{me}-{time.time_ns()}-{os.getpid()}", reason[:500], me,
                             self.host, now)
        rnd = self.round
        raw = self._try(lambda: self.channel.put_first(self._rk("request", rnd),
                                                       encode(req.to_json())), None)
        if raw is None:
            return None
        got = self._accept(raw, rnd)
        if got is None:  # a stale request of an earlier job holds the key: ours stands locally
            with self._lock:
                self._request = self._request or req
                self.request_event.set()
                return self._request
        return got

    def poll_capture_request(self) -> CaptureRequest | None:
        """Non-blocking. With the background thread running this costs nothing."""
        if self._request is not None:
            return self._request
        if self._thread is not None and self._thread.is_alive():
            return None
        rnd = self.round
        return self._accept(self._try(lambda: self.channel.get(self._rk("request", rnd)), None),
                            rnd)

    def wait_capture_request(self, timeout: float) -> CaptureRequest | None:
        if self._request is not None:
            return self._request
        rnd = self.round
        if self._try(lambda: self.channel.wait(self._rk("request", rnd), timeout), False):
            return self._accept(self._try(lambda: self.channel.get(self._rk("request", rnd)),
                                          None), rnd)
        return None

    def publish_capture(self, summary: NodeSummary, request: CaptureRequest | None) -> bool:
        summary.node, summary.kind = self.node, "capture"
        summary.request = request.id if request else None
        data = summary.encode()
        ns = self._rk("captured")
        return self._done(lambda: self.channel.put_member(ns, self.node, data))

    def wait_all_captured(self, expected: Sequence[str], deadline: float, *,
                          request: CaptureRequest | None = None, dead_after_s: float = 5.0,
                          unregistered_grace_s: float = 5.0,
                          ) -> tuple[dict[str, NodeSummary], list[str]]:
        """Until every expected node published its capture (for ``request``), or ``deadline``
        (``time.monotonic()``). Gives up early on a node that never registered (after
        ``unregistered_grace_s``) and on one whose watcher stopped beating for ``dead_after_s``.
        Returns (captured, missing)."""
        want = [sanitize(n) for n in expected] or [self.node]
        captured: dict[str, NodeSummary] = {}
        t_start = time.monotonic()
        last_alive: dict[str, tuple[bytes | None, float]] = {}
        given_up: set[str] = set()
        next_liveness = t_start + min(1.0, dead_after_s / 3)
        while not self.gone:
            pending = [n for n in want if n not in captured and n not in given_up]
            if not pending:
                break
            listed: list[str] = self._try(
                functools.partial(self.channel.members, self._rk("captured"), pending), [])
            fresh = [n for n in pending if n in listed]
            if fresh:
                got: list[bytes | None] = self._try(functools.partial(
                    self.channel.get_many, [self._rk(f"captured/{n}") for n in fresh]), [])
                for n, raw in zip(fresh, got, strict=False):
                    s = NodeSummary.decode(raw)
                    if s is not None and (request is None or s.request == request.id):
                        captured[n] = s
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_liveness:
                next_liveness = now + min(1.0, dead_after_s / 3)
                if self._thread is None:
                    self.beat()  # nobody else beats for us while we wait
                pending = [n for n in want if n not in captured and n not in given_up]
                no_beats: list[bytes | None] = [None] * len(pending)
                nodes_seen: list[str] = self._try(
                    functools.partial(self.channel.members, "node", pending), [])
                registered = set(nodes_seen)
                beats = self._try(functools.partial(
                    self.channel.get_many, [f"alive/{n}" for n in pending]), no_beats)
                for n, b in zip(pending, beats, strict=False):
                    if n not in registered:
                        if now - t_start >= unregistered_grace_s:
                            given_up.add(n)
                        continue
                    seen = last_alive.get(n)
                    if seen is None or seen[0] != b:
                        last_alive[n] = (b, now)
                    elif b is not None and now - seen[1] >= dead_after_s:
                        given_up.add(n)  # registered, beat, then stopped: its watcher died
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        missing = sorted((n for n in want if n not in captured), key=_node_sort_key)
        return captured, missing

    # ------------------------------------------------------------------ verdict

    def make_verdict(self, verdict: Mapping[str, Any], request: CaptureRequest,
                     captured: Mapping[str, NodeSummary], missing: Sequence[str], *,
                     world: int | None = None, local_only: bool = False,
                     note: str | None = None) -> GlobalVerdict:
        lw = self.local_world or next((s.local_world for s in captured.values() if s.local_world),
                                      None)
        w = world or next((s.world for s in captured.values() if s.world), None)
        covered = {r.rank for s in captured.values() for r in s.ranks}
        unknown = sorted(set(range(w)) - covered) if w else ranks_of_nodes(missing, lw)
        return GlobalVerdict(
            request=request.id, by_node=self.node, time=time.time(), verdict_data=dict(verdict),
            captured=sorted(captured, key=_node_sort_key), missing=list(missing),
            hosts={n: s.host for n, s in sorted(captured.items())}, unknown_ranks=unknown,
            local_only=local_only, note=note, _summaries=dict(captured))

    def publish_verdict(self, verdict: GlobalVerdict) -> GlobalVerdict | None:
        """First verdict wins; returns the one every node prints (perhaps another node's).
        The global set goes first, under this node's name: a verdict seen implies its set."""
        if verdict.global_raw is None:
            verdict.global_raw = encode({n: s.to_json(stacks=False)
                                         for n, s in verdict.summaries.items()})
        data = verdict.global_raw
        gkey, vkey = self._rk(f"global/{self.node}"), self._rk("verdict")
        bkey = self._rk(f"verdict-body/{self.node}")
        if verdict.verdict_raw is None:
            verdict.verdict_raw = encode(verdict.verdict)
        body = verdict.verdict_raw
        if not self._done(lambda: self.channel.put(gkey, data)) or \
                not self._done(lambda: self.channel.put(bkey, body)):
            return None
        head = encode(verdict.record_json())
        raw = self._try(lambda: self.channel.put_first(vkey, head), None)
        if raw == head:
            return verdict
        return self._decode_verdict(raw)

    def _decode_verdict(self, raw: bytes | None) -> GlobalVerdict | None:
        d = decode(raw)
        if not isinstance(d, Mapping):
            return None
        try:
            by = sanitize(str(d.get("by_node", "")))
            gkey, bkey = self._rk(f"global/{by}"), self._rk(f"verdict-body/{by}")
            nothing: list[bytes | None] = [None, None]
            glob, body = self._try(lambda: self.channel.get_many([gkey, bkey]), nothing)
            return GlobalVerdict.from_json(d, glob, body)
        except (KeyError, TypeError, ValueError):
            return None

    def read_verdict(self, timeout: float = 0.0) -> GlobalVerdict | None:
        vkey = self._rk("verdict")
        if timeout > 0 and not self._try(lambda: self.channel.wait(vkey, timeout), False):
            return None
        return self._decode_verdict(self._try(lambda: self.channel.get(vkey), None))

    # ------------------------------------------------------------------ ending

    def ack_ended(self) -> bool:
        """This node has the verdict and is about to end its job."""
        now = str(time.time()).encode()
        ns = self._rk("ended")
        return self._done(lambda: self.channel.put_member(ns, self.node, now))

    def wait_ended(self, nodes: Sequence[str], timeout: float) -> list[str]:
        """On the node hosting the store: wait (bounded) until ``nodes`` acknowledged; returns
        those that did not."""
        want = {sanitize(n) for n in nodes} - {self.node}
        end = time.monotonic() + timeout
        while want and not self.gone:
            acked: list[str] = self._try(
                functools.partial(self.channel.members, self._rk("ended"), sorted(want)), [])
            want -= set(acked)
            if not want or time.monotonic() >= end:
                break
            time.sleep(self.poll_s)
        return sorted(want, key=_node_sort_key)
