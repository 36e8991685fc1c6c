"""One node's side of the protocol (:class:`Coordinator`): the background thread, and one round
from a capture request to the moment this node may end its job."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from moe_hang.runtime.coord.channel import _node_sort_key, sanitize
from moe_hang.runtime.coord.exchange import _Exchange
from moe_hang.runtime.coord.records import CaptureRequest, GlobalVerdict, RoundResult
from moe_hang.runtime.coord.summary import NodeSummary

Analyse = Callable[[dict[str, NodeSummary], list[str]], dict[str, Any]]


class Coordinator(_Exchange):
    """One node's side of the protocol. No method raises on a channel failure: each returns
    its "nothing" (False, None, empty) and :attr:`gone` says why; the caller then goes on
    local-only."""

    # ------------------------------------------------------------------ background

    def start(self, interval: float = 1.0, publish_every_s: float = 2.0) -> None:
        """Background thread: liveness beats, offered summaries, and the capture request
        (a blocking wait on the store: seen within milliseconds, no polling)."""
        if self._thread is not None:
            return

        self._current_round()

        def loop() -> None:
            while not self._stop.is_set() and not self.gone:
                if self._request is None:
                    rnd = self.round
                    key = self._rk("request", rnd)
                    if self._try(functools.partial(self.channel.wait, key, interval), False):
                        self._accept(self._try(functools.partial(self.channel.get, key), None),
                                     rnd)
                else:
                    self._stop.wait(interval)
                if self._stop.is_set():
                    break
                self.beat()
                with self._lock:
                    offered, fp = self._offered, self._offered_fp
                now = time.monotonic()
                if (offered is not None and fp != self._published_fp
                        and now - self._last_pub >= publish_every_s
                        and self.publish_summary(offered)):
                    self._published_fp, self._last_pub = fp, now

        self._thread = threading.Thread(target=loop, name="moe-hang-coord", daemon=True)
        self._thread.start()

    def capture_requested(self) -> CaptureRequest | None:
        """The request seen by the background thread (or made here), without any I/O."""
        return self._request

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        self.channel.close()

    # ------------------------------------------------------------------ one round

    def _alive_counter(self, node: str) -> bytes | None:
        return self._try(lambda: self.channel.get(f"alive/{sanitize(node)}"), None)

    def _await_verdict(self, analyst: str, timeout: float,
                       dead_after_s: float) -> tuple[GlobalVerdict | None, str | None]:
        """A node that does not analyse waits for the analyst's verdict: a blocking wait on
        the store (no polling), in slices, watching the analyst's beat. Returns (verdict, why
        not), the reason once the analyst stopped beating for ``dead_after_s``."""
        end = time.monotonic() + timeout
        beat, since = self._alive_counter(analyst), time.monotonic()
        while not self.gone:
            left = end - time.monotonic()
            if left <= 0:
                return None, "no verdict in time"
            if self._try(functools.partial(self.channel.wait, self._rk("verdict"), min(1.0, left)),
                         False):
                self._verdict_seen = time.monotonic()  # before reading it
                return self.read_verdict(), None
            b, now = self._alive_counter(analyst), time.monotonic()
            if b != beat:
                beat, since = b, now
            elif now - since >= dead_after_s:
                return None, f"node {analyst} (the analyst) stopped answering"
        return None, self.gone

    def run_round(self, request: CaptureRequest, capture: Callable[[], NodeSummary],
                  analyse: Analyse, expected: Sequence[str], *, world: int | None = None,
                  capture_timeout_s: float = 30.0, verdict_timeout_s: float = 20.0,
                  end_wait_s: float = 15.0, dead_after_s: float = 5.0,
                  unregistered_grace_s: float = 5.0) -> RoundResult:
        """Everything from a capture request to the moment this node may end its job.

        Every node captures and publishes. The requester (or, when the request came from
        outside the watchers, e.g. ``diagnose``, the lowest expected node) waits for all
        captures (or the deadline), analyses and publishes the verdict with the global set;
        every other node
        waits for that verdict (it does not poll the captures: at 1000 nodes that would be
        1000 pollers). If the requester stops beating, the others wait for the captures
        themselves and analyse: the first verdict published wins, so all print the same one.
        Then acknowledgements, and the node hosting the store waits for them. Bounded by
        ``capture_timeout_s + verdict_timeout_s + end_wait_s`` plus the local capture.
        Call :meth:`start` first: the requester's beats are what the others watch."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        mine = capture()
        timings["captured_here"] = time.monotonic() - t0
        self.publish_capture(mine, request)
        want = [sanitize(n) for n in expected]
        captured: dict[str, NodeSummary] = {self.node: mine}
        missing: list[str] = []
        analysed_here = False
        why: str | None = None

        def gather(until: float) -> None:
            nonlocal captured, missing
            got, missing = self.wait_all_captured(
                want, until, request=request, dead_after_s=dead_after_s,
                unregistered_grace_s=unregistered_grace_s)
            got.setdefault(self.node, mine)
            captured = got
            missing = [n for n in missing if n != self.node]
            timings["all_captured"] = time.monotonic() - t0

        def analyse_and_publish() -> GlobalVerdict | None:
            nonlocal analysed_here
            analysed_here = True
            return self.publish_verdict(self.make_verdict(
                analyse(captured, missing), request, captured, missing, world=world))

        verdict: GlobalVerdict | None = None
        self._verdict_seen = None
        analyst = (request.by_node if request.by_node in want or not want
                   else sorted(want, key=_node_sort_key)[0])
        if self.gone:
            why = self.gone
        elif analyst == self.node:
            gather(t0 + capture_timeout_s)
            verdict = analyse_and_publish()
        else:
            verdict, why = self._await_verdict(analyst, capture_timeout_s + verdict_timeout_s,
                                               dead_after_s)
            if verdict is None and not self.gone:
                gather(t0 + capture_timeout_s + verdict_timeout_s)
                verdict = analyse_and_publish()
        if verdict is not None and verdict.request != request.id:
            why = (f"{self.channel.describe()} holds the verdict of another round "
                   f"({verdict.request}): give each job its own shared directory")
            verdict = None
        if verdict is None:
            others = sorted(set(want) - {self.node}, key=_node_sort_key)
            note = f"{self.gone or why or 'no verdict'}: local ranks only"
            verdict = self.make_verdict(analyse({self.node: mine}, others), request,
                                        {self.node: mine}, others, world=world,
                                        local_only=True, note=note)
            analysed_here, captured, missing = True, {self.node: mine}, others
        timings["verdict"] = time.monotonic() - t0
        timings["verdict_seen"] = (self._verdict_seen or time.monotonic()) - t0
        not_ended: list[str] = []
        if not verdict.local_only:
            missing = verdict.missing  # the global set itself: verdict.summaries (decoded lazily)
            self.ack_ended()
            if self.hosts_store:
                not_ended = self.wait_ended(verdict.captured, end_wait_s)
        timings["ended"] = time.monotonic() - t0
        return RoundResult(verdict, request, captured, missing, analysed_here, timings, not_ended)
