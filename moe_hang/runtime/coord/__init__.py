"""Coordination of the ``moe-hang watch`` processes of one multi-node job.

One watcher runs per node. They talk through one channel, under a prefix of their own
(``moe-hang/<run key>/``), and nothing else:

* :class:`StoreChannel`: a client of the ``torch.distributed.TCPStore`` the job already has:
  torchrun's rendezvous store (``--rdzv-endpoint``; static rendezvous: ``--master-addr:port``),
  which lives in one torchrun agent and which every agent must reach (the ranks'
  MASTER_ADDR:MASTER_PORT is another store under c10d, on group rank 0's agent, random port).
  torch is imported lazily, on first connect: a single-node ``watch`` never imports it.
* :class:`DirChannel`: a directory every node sees (``--shared-dir``), for clusters where the
  store cannot be reached from outside the ranks. Atomic writes (temp + rename, ``link`` for
  first-writer-wins).

Every channel operation runs on a worker thread of its own and the caller waits a bounded time:
a store whose host vanished (a partition blocks a TCPStore ``get`` far beyond its own timeout)
or a hung NFS mount turns into :class:`ChannelGone`, never into a hung watcher. Once gone, a
channel stays gone, every later call fails at once, and :class:`Coordinator` falls back to a
local-only verdict that names the other nodes *unknown*.

The protocol (:meth:`Coordinator.run_round` runs it end to end)::

    register(node, host, local ranks, watcher pid)      node/<id>, alive/<id> (beat)
    publish_summary(NodeSummary)  (periodic)            summary/<id>
    request_capture(reason, by_node)  first one wins    request
    -- every node: capture its ranks, then --
    publish_capture(NodeSummary after capture)          captured/<id>
    wait_all_captured(expected, deadline)               -> (captured, missing)
    the requester analyses and publishes the verdict    verdict  (first one wins)
    everybody else reads it (or, if the requester died,  (carries the compact global set)
      analyses itself and publishes: first one wins)
    ack_ended()                                         ended/<id>
    the node hosting the store waits for the acks, then ends its job; the others end at once

Missing nodes are unknown, not guilty: a node that never registered or whose watcher stopped
beating is reported in ``missing`` and its ranks in ``unknown_ranks``.

One job a module: :mod:`.channel` (the channel protocol, keys), :mod:`.worker` (bounded
calls), :mod:`.store` and :mod:`.shareddir` (the two channels), :mod:`.codec` (values),
:mod:`.summary` and :mod:`.records` (what travels), :mod:`.heartbeats` (summaries from the
probes' heartbeats), :mod:`.endpoint` (where the job's store is), :mod:`.membership`,
:mod:`.exchange` and :mod:`.coordinator` (the protocol), :mod:`.verdict` (a verdict from
summaries alone).
"""

from __future__ import annotations

from moe_hang.runtime.coord.channel import ROOT, Channel, ChannelGone, key_prefix, run_key, sanitize
from moe_hang.runtime.coord.codec import SCHEMA, decode, encode
from moe_hang.runtime.coord.coordinator import Analyse, Coordinator
from moe_hang.runtime.coord.endpoint import (
    StoreEndpoint,
    endpoint_from_rank_env,
    endpoint_from_torchrun,
    launches_torchrun,
    store_listener_pid,
    torchrun_max_restarts,
)
from moe_hang.runtime.coord.heartbeats import (
    expected_nodes,
    node_id_from_heartbeats,
    parse_frame,
    ranks_of_nodes,
    remote_moving,
    summarize_heartbeats,
    to_heartbeats,
)
from moe_hang.runtime.coord.records import CaptureRequest, GlobalVerdict, NodeInfo, RoundResult
from moe_hang.runtime.coord.shareddir import DirChannel
from moe_hang.runtime.coord.store import StoreChannel, preload_torch
from moe_hang.runtime.coord.summary import NodeSummary, PendingCollective, RankSummary
from moe_hang.runtime.coord.verdict import basic_verdict

__all__ = [
    "ROOT",
    "SCHEMA",
    "Analyse",
    "CaptureRequest",
    "Channel",
    "ChannelGone",
    "Coordinator",
    "DirChannel",
    "GlobalVerdict",
    "NodeInfo",
    "NodeSummary",
    "PendingCollective",
    "RankSummary",
    "RoundResult",
    "StoreChannel",
    "StoreEndpoint",
    "basic_verdict",
    "decode",
    "encode",
    "endpoint_from_rank_env",
    "endpoint_from_torchrun",
    "expected_nodes",
    "key_prefix",
    "launches_torchrun",
    "node_id_from_heartbeats",
    "parse_frame",
    "preload_torch",
    "ranks_of_nodes",
    "remote_moving",
    "run_key",
    "sanitize",
    "store_listener_pid",
    "summarize_heartbeats",
    "to_heartbeats",
    "torchrun_max_restarts",
]
