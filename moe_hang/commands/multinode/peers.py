"""The other watchers of a job that spans nodes, as ``watch``'s one policy sees them
(:class:`NodePeers`, a :class:`moe_hang.commands.supervise.Peers`): every decision is taken on
the one global verdict, so that every node acts alike."""

from __future__ import annotations

from collections.abc import Callable

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.commands.multinode.node import Node
from moe_hang.commands.supervise import AloneOnNode, Peers
from moe_hang.runtime.monitor import Monitor
from moe_hang.runtime.watchevent import EventKind, WatchEvent


class NodePeers:
    def __init__(self, node: Node) -> None:
        self.node = node

    def tick(self, mon: Monitor) -> bool:
        return self.node.tick(mon)

    def requested(self) -> bool:
        co = self.node.co
        return co is not None and co.capture_requested() is not None

    def moving_elsewhere(self) -> dict[str, list[int]]:
        return self.node.moving_elsewhere() if self.node.co is not None else {}

    def recheck_s(self) -> float:
        return self.node.summary_lag_s()

    def alone(self) -> bool:
        return self.node.co is None

    def round(self, mon: Monitor, event: WatchEvent, kind: EventKind,
              capture: Callable[[], Diagnosis]) -> tuple[Diagnosis, EventKind]:
        got = self.node.run_round(mon, event, kind, capture)
        return got.diagnosis, got.kind

    def next_round(self) -> None:
        self.node.next_round()

    def completed(self, event: WatchEvent) -> None:
        self.node.close(final=dict.fromkeys(event.rank_pids, True))


class SpreadLater:
    """The other watchers of a job not started by torchrun (srun, mpirun, a launcher of the
    job's own), whose command line does not say whether it spans nodes: a job on one node
    until its ranks are up; then, where their world is larger than the ranks here, this
    node's part of a job that spans nodes (``join``: the :class:`Node`, or None)."""

    def __init__(self, join: Callable[[Monitor], Node | None]) -> None:
        self.join = join
        self.node: Node | None = None
        self._peers: Peers = AloneOnNode()
        self._looked = False

    def _decide(self, mon: Monitor) -> None:
        # ranks up by sampling are not yet decided: their probes may start late (a loaded
        # machine), and only their heartbeats say the world; the monitor leaves sampling and
        # sets t_up again once every beat is in
        if not self._looked and mon.out.t_up is not None and not mon.out.sampled:
            self._looked = True
            node = self.join(mon)
            if node is not None:
                self.node, self._peers = node, NodePeers(node)

    def tick(self, mon: Monitor) -> bool:
        self._decide(mon)
        return self._peers.tick(mon)

    def requested(self) -> bool:
        return self._peers.requested()

    def moving_elsewhere(self) -> dict[str, list[int]]:
        return self._peers.moving_elsewhere()

    def recheck_s(self) -> float:
        return self._peers.recheck_s()

    def alone(self) -> bool:
        return self._peers.alone()

    def round(self, mon: Monitor, event: WatchEvent, kind: EventKind,
              capture: Callable[[], Diagnosis]) -> tuple[Diagnosis, EventKind]:
        # the event may have come in the very poll the ranks came up in (a rank that raised
        # early): decide first whether there are others to give it to
        self._decide(mon)
        if self.node is not None:
            self._peers.tick(mon)  # registers this node before the round
        return self._peers.round(mon, event, kind, capture)

    def next_round(self) -> None:
        self._peers.next_round()

    def completed(self, event: WatchEvent) -> None:
        self._peers.completed(event)
