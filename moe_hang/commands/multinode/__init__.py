"""Multi-node ``watch`` and ``diagnose``: one watcher per node, one verdict for the job.

Each node's ``moe-hang watch`` is the parent of that node's torchrun agent and sees only its
own ranks. The watchers coordinate through the store the job already has (torchrun's
rendezvous endpoint) or a directory every node sees (``--shared-dir``), under
``moe-hang/<run key>/`` (:mod:`moe_hang.runtime.coord`): each publishes a compact summary of
its ranks; the first watcher to see a stall, a desync or a failure posts a capture request;
every node captures its own ranks and publishes the result; one node (the requester) analyses
its own capture plus the others' summaries and publishes the verdict; every node prints that
same verdict and saves it; nobody ends anything before that (or before a bounded deadline),
and the node hosting the store ends its job last.

What is not known is not blamed: the ranks of a node whose watcher never answered are
*unknown* (``Evidence.unreached``), and the rule "waits on unknown ranks"
(:mod:`moe_hang.analysis.unreached`) says whom the known ranks wait for and where to look.

Nothing here runs unless the job is multi-node (its torchrun command line says so) or
``--shared-dir`` is given: a single-node ``watch`` never imports torch and behaves as before.

One job a module: :mod:`.connect` (reaching the other watchers), :mod:`.summaries` (what a
node publishes, and the others' captures and summaries as evidence), :mod:`.requests` (what
a capture request was for), :mod:`.node` (this watcher's part), :mod:`.peers` (the other
watchers, as the one watch policy, :mod:`moe_hang.commands.supervise`, sees them).
"""

from __future__ import annotations

from moe_hang.commands.multinode.connect import (
    Plan,
    check_shared_dir,
    open_channel,
    peers_for_diagnose,
    plan,
    plan_from_ranks,
)
from moe_hang.commands.multinode.node import (
    Node,
    RoundOutcome,
    block_of,
    unreached_ranks,
)
from moe_hang.commands.multinode.peers import NodePeers, SpreadLater
from moe_hang.commands.multinode.requests import request_kind
from moe_hang.commands.multinode.summaries import (
    capture_summary,
    merge_remote,
    raw_heartbeats,
)

__all__ = [
    "Node",
    "NodePeers",
    "Plan",
    "RoundOutcome",
    "SpreadLater",
    "block_of",
    "capture_summary",
    "check_shared_dir",
    "merge_remote",
    "open_channel",
    "peers_for_diagnose",
    "plan",
    "plan_from_ranks",
    "raw_heartbeats",
    "request_kind",
    "unreached_ranks",
]
