"""How a watcher's node opens its channel to the other nodes (:class:`NodeChannel`, a part of
:class:`~moe_hang.commands.multinode.node.Node`), in a background thread: the job's store as
soon as it appears, or the shared directory; on the node whose agent hosts that store, the
watchers' own relay, named there; a relay that went, back to the job's store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from moe_hang.commands.multinode.connect import Plan, _agent_endpoint, open_channel
from moe_hang.runtime import coord
from moe_hang.runtime.coord import Channel, Coordinator, StoreChannel
from moe_hang.runtime.coord.relay import RELAY_KEY, Relay, local_address, open_relay
from moe_hang.settings import Settings

if TYPE_CHECKING:
    from moe_hang.runtime.launcher import LaunchedJob


class NodeChannel:
    """The channel half of a node's state; :class:`~moe_hang.commands.multinode.node.Node`
    holds the rest (and the methods this part calls back)."""

    plan: Plan
    timings: Settings  # how long to try the store, wait for the relay, fall back
    notice: Callable[[str], None]
    node: str
    host: str
    co: Coordinator | None
    world: int | None
    local_world: int | None
    local_ranks: list[int]
    why_local: str | None
    publish_s: float
    job: LaunchedJob | None
    _up: threading.Event
    _ready: threading.Event
    _closed: threading.Event
    _lock: threading.Lock
    _relay: Relay | None
    _on_relay: bool
    _hosts: bool
    expected: Callable[[], list[str]]

    def _run(self) -> None:
        try:
            self._connect()
        finally:
            self._ready.set()

    def _connect(self) -> None:
        ch: Channel | None = None
        if self.plan.shared_dir is None:  # the store may appear after us: connect early
            ch, why = open_channel(self.plan, connect_s=self.timings.store_connect_s,
                                   stop=self._closed)
            if ch is None:
                self.why_local = why
                return
        while not self._up.wait(0.25):
            if self._closed.is_set():
                if ch is not None:
                    ch.close()
                return
            if isinstance(ch, StoreChannel) and self._relay is None \
                    and self.plan.endpoint is not None and self._hosts_store(self.plan.endpoint):
                # name the relay early: the others look for it once their ranks are up
                self._serve_relay(ch)
        pids = self._pids()
        ep = self.plan.endpoint or _agent_endpoint(pids)
        if ch is None:
            if self.plan.endpoint is None and ep is not None:
                # the watched command wraps torchrun (ip netns exec, bash -c, a container):
                # the run id is the agent's, as diagnose will read it
                self.plan.run = coord.run_key(ep.run_id)
            ch, self.why_local = open_channel(self.plan, connect_s=0.0)
            if ch is None:
                return
        self._hosts = hosts = ep is not None and self._hosts_store(ep)
        if isinstance(ch, StoreChannel):
            if hosts and self._relay is None:
                self._serve_relay(ch)
            job_store = ch
            ch = self._to_relay(ch, wait_s=0.0 if hosts else self.timings.relay_wait_s)
            self._on_relay = ch is not job_store
        self._start(ch)

    def _fall_back(self, gone: str) -> None:
        """The relay went while this node's job runs on: its watcher was killed alone (its
        agent, and the job's store, may live). Back to the job's store, registered anew (the
        others, losing the relay too, do the same); nothing if that store is gone as well."""
        ch, _ = open_channel(self.plan, connect_s=self.timings.store_fallback_s,
                             stop=self._closed)
        if ch is None:
            return
        self.notice(f"the watchers' relay is gone ({gone[:120]}); back on "
                    f"{self.plan.describe()}")
        self._start(ch)

    def _start(self, ch: Channel) -> None:
        """Register on ``ch`` and start the coordinator's thread there."""
        co = Coordinator(ch, self.node, self.host)
        co.register(self.local_ranks, hosts_store=self._hosts, world=self.world,
                    local_world=self.local_world)
        with self._lock:
            if self._closed.is_set():
                co.close()
                return
            self.publish_s = max(2.0, len(self.expected()) / 100)
            co.start(interval=1.0, publish_every_s=self.publish_s)
            old, self.co = self.co, co
        if old is not None:
            old.close()  # the relay's, gone

    def _pids(self) -> list[int]:
        return [self.job.pid, *self.job.tracker.seen] if self.job is not None else []

    def _hosts_store(self, ep: coord.StoreEndpoint) -> bool:
        return coord.store_listener_pid(ep.port, self._pids()) is not None

    def _serve_relay(self, ch: StoreChannel) -> None:
        """This node's agent hosts the job's store: serve the watchers' own (the relay) and
        name it there. Without it (no address, a failed write) the watchers stay on the
        job's store, as before."""
        addr = local_address(ch.host, ch.port)
        if addr is None:
            return
        try:
            relay = Relay(addr, self.timings.relay_op_timeout_s)
        except Exception:  # a server we cannot start is only a relay we do not have
            return
        try:
            ch.put(RELAY_KEY, relay.spec())
        except coord.ChannelGone:
            relay.close()
            return
        self._relay = relay

    def _to_relay(self, ch: StoreChannel, wait_s: float) -> Channel:
        """The relay's channel when one is named in the job's store (waiting up to ``wait_s``
        for the store's node to name it), the job's store's otherwise."""
        try:
            raw = ch.get(RELAY_KEY)
            if raw is None and wait_s > 0 and ch.wait(RELAY_KEY, wait_s):
                raw = ch.get(RELAY_KEY)
        except coord.ChannelGone:
            return ch
        relay = open_relay(raw, self.plan.run, connect_s=self.timings.relay_connect_s)
        if relay is None:
            return ch
        ch.close()
        return relay
