"""NCCL's own evidence: the RAS status report (NCCL >= 2.24), read — pure.

Every NCCL process runs a RAS thread; any of them answers a client on ``localhost:28028``
(``NCCL_RAS_ADDR``) with the state of every communicator of the job, gathered from all its
processes: each rank's state (initialized, async error, finalize/destroy/abort flags), which ranks
RAS cannot reach or considers dead, and per rank how many collectives of each kind it has
launched.

Those counts are **launch counts, without send/recv**: NCCL bumps them when a collective's
kernel is launched, not when it completes, only for Broadcast, Reduce, AllGather, ReduceScatter
and AllReduce (no send/recv, hence no all-to-all), and not for collectives captured in CUDA
graphs. Two reports a few seconds apart tell moving from frozen, and in a frozen communicator
whose counts disagree, the ranks behind never launched what the others wait in.

``read`` (either format) -> ``records`` (:class:`RasReport`); ``ranks`` maps communicator ranks
to global ranks by (host, pid), ``mapping`` infers what the tool knows no alias for;
``evidence`` (:class:`RasEvidence`) is what a diagnosis holds of them; the capture side
(asking a live job) is :mod:`moe_hang.capture.ras`. What they say together (moving, frozen,
behind, and the sentences, each with the launch caveat) is :mod:`moe_hang.analysis.ras`'s.
"""

from moe_hang.evidence.ras.evidence import (
    RasEvidence,
    RasPoll,
    differ,
    order_polls,
    ras_evidence,
)
from moe_hang.evidence.ras.mapping import BY_PROCESS, BY_WORLD, infer_global_ranks
from moe_hang.evidence.ras.ranks import ProcessKey, comm_global_ranks, global_rank_maps
from moe_hang.evidence.ras.read import load_report, parse_report
from moe_hang.evidence.ras.records import (
    COUNTED_OPS,
    DEFAULT_PORT,
    RankState,
    RasCommunicator,
    RasCountGroup,
    RasMissingRank,
    RasRank,
    RasRankFlags,
    RasReport,
    RasReportError,
    RasStatusGroup,
)

__all__ = [
    "BY_PROCESS", "BY_WORLD", "COUNTED_OPS", "DEFAULT_PORT", "ProcessKey", "RankState",
    "RasCommunicator", "RasCountGroup", "RasEvidence", "RasMissingRank", "RasPoll", "RasRank",
    "RasRankFlags", "RasReport", "RasReportError", "RasStatusGroup", "comm_global_ranks",
    "differ", "global_rank_maps", "infer_global_ranks", "load_report", "order_polls",
    "parse_report", "ras_evidence",
]
