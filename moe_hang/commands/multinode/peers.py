"""The other watchers of a job that spans nodes, as ``watch``'s one policy sees them
(:class:`NodePeers`, a :class:`moe_hang.commands.supervise.Peers`): every decision is taken on
the one global verdict, so that every node acts alike."""

from __future__ import annotations

from collections.abc import Callable

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.commands.multinode.node import Node
from moe_hang.runtime.monitor import EventKind, Monitor, WatchEvent


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
