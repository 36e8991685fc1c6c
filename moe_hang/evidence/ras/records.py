"""What a NCCL RAS status report becomes: :class:`RasReport` of :class:`RasCommunicator` s,
each with its live :class:`RasRank` s and its :class:`RasMissingRank` s — pure.

One record type for both of NCCL's formats. The JSON report (NCCL >= 2.28.7) is a dump of every
rank's raw state; the text report (every release since 2.24, the default) is a summary: it lists
a communicator only when something is wrong with it and names ranks only for outlier groups, so
its communicators carry :class:`RasCountGroup` s and :class:`RasStatusGroup` s instead of every
rank's counts (``complete`` is False).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# NCCL's five counted collectives, in its own order (ncclFuncStr; NCCL_NUM_FUNCTIONS = 5,
# "Send/Recv not included for now")
COUNTED_OPS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
# the text report of NCCL < 2.26 counts every collective together, under this name
ALL_COLLECTIVES = "collective"

DEFAULT_PORT = 28028  # NCCL_RAS_CLIENT_PORT
UNKNOWN_HOST = "unknown"  # what the JSON writer puts when RAS could not find the process

# ncclResult_t: what init_state and async_error hold
NCCL_RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
                3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
                6: "ncclRemoteError", 7: "ncclInProgress", 8: "ncclTimeout"}
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7  # init_state: initialization still ongoing; not an error


def nccl_result(code: int) -> str:
    return NCCL_RESULTS.get(code, f"NCCL error {code}")


class RankState(str, Enum):
    """A rank's state as NCCL's text report derives it (client_support.cc): abort beats
    finalize/destroy beats a finished init (RUNNING) beats the rest (INIT). NOCOMM: the process
    answered but is not (or no longer) a member of the communicator."""

    RUNNING = "RUNNING"
    INIT = "INIT"
    FINALIZE = "FINALIZE"
    ABORT = "ABORT"
    NOCOMM = "NOCOMM"
    UNKNOWN = "UNKNOWN"  # the text report of NCCL < 2.26 for NOCOMM; or not said


@dataclass(frozen=True)
class RasRankFlags:
    """A live rank's ``status`` object in the JSON report."""

    init_state: int  # ncclResult_t: 0 initialized, 7 still initializing, else an init error
    async_error: int  # what ncclCommGetAsyncError would return (0: none)
    finalize_called: bool
    destroy_flag: bool  # set by ncclCommDestroy and ncclCommAbort
    abort_flag: bool

    @property
    def state(self) -> RankState:
        if self.abort_flag:
            return RankState.ABORT
        if self.finalize_called or self.destroy_flag:
            return RankState.FINALIZE
        return RankState.RUNNING if self.init_state == NCCL_SUCCESS else RankState.INIT

    @property
    def error(self) -> str | None:
        """The NCCL error this rank holds, as NCCL marks a communicator ERROR (an init state or
        an asynchronous error other than success or in-progress), else None."""
        if self.init_state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            return f"initialization failed with {nccl_result(self.init_state)}"
        if self.async_error not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            return f"asynchronous error {nccl_result(self.async_error)}"
        return None


@dataclass(frozen=True)
class RasRank:
    """One live rank of a communicator. ``host`` is the IP address of the process's RAS
    socket (NCCL never resolves names); ``pid`` -1 and host "unknown" when RAS did not find it."""

    rank: int  # the rank within this communicator, not the job's global rank
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int  # unique per node; cuda_dev repeats under CUDA_VISIBLE_DEVICES
    flags: RasRankFlags | None = None  # None: the text report does not say
    # launches per op (COUNTED_OPS); empty when the report does not say (text, not an outlier)
    collective_counts: dict[str, int] = field(default_factory=dict)
    state_hint: RankState | None = None  # the text report's "Rank 3 has status FINALIZE"

    @property
    def state(self) -> RankState:
        if self.flags is not None:
            return self.flags.state
        return self.state_hint or RankState.UNKNOWN


@dataclass(frozen=True)
class RasMissingRank:
    """A rank RAS has no data about for this communicator."""

    rank: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int
    unresponsive: bool  # RAS could not reach its process (else: reachable, not a member)
    considered_dead: bool  # unreachable for 60 s: RAS stopped trying


@dataclass(frozen=True)
class RasCountGroup:
    """Ranks of a communicator that launched one op the same number of times, as the text
    report prints them (only for a communicator whose counts disagree); ``ranks`` holds the
    members it names, which may be fewer than ``n_ranks`` (it names only outliers)."""

    op: str  # one of COUNTED_OPS, or ALL_COLLECTIVES (NCCL < 2.26)
    count: int
    n_ranks: int
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class RasStatusGroup:
    """Ranks of a communicator with one state (text report: "2 ranks have status FINALIZE")."""

    state: RankState
    n_ranks: int
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class RasCommunicator:
    hash: str  # canonical "0x%016x": JSON writes "0x%lx", text "%016lx"
    size: int  # the communicator's rank count (0: the text report did not say)
    ranks: tuple[RasRank, ...] = ()
    missing_ranks: tuple[RasMissingRank, ...] = ()
    secondary_hash: str = ""  # JSON only; with hash, unique (hash alone almost surely is)
    complete: bool = True  # every live rank with its state and counts (the JSON report)
    label: str = ""  # the text report's "#0-1" (group 0, communicator 1 of the group)
    count_groups: tuple[RasCountGroup, ...] = ()  # text only
    status_groups: tuple[RasStatusGroup, ...] = ()  # text only
    errors: tuple[str, ...] = ()  # text only: the lines of its ERROR block
    error_ranks: tuple[int, ...] = ()  # text only: the ranks its ERROR block names

    @property
    def key(self) -> str:
        """The identity to pair a communicator across two reports."""
        return f"{self.hash}:{self.secondary_hash}" if self.secondary_hash else self.hash


@dataclass(frozen=True)
class RasProcess:
    """A process the text report names at job level (missing data from it, or dead)."""

    pid: int
    host: str
    gpus: str  # "5", "0,1", "3 (NVML 7)"


@dataclass(frozen=True)
class RasGroupRow:
    """One row of the text report's communicator table (communicators alike in size, node
    count, state and errors)."""

    group: int
    comms: int
    nodes_per_comm: int
    ranks_per_node: str  # "8" or "7-8"
    ranks_per_comm: int
    ranks_in_group: int
    state: str  # RUNNING, INIT, FINALIZE, ABORT, NOCOMM
    errors: str  # OK, MISMATCH, ERROR, INCOMPLETE, or several joined by ","


@dataclass(frozen=True)
class RasReport:
    fmt: str  # "json" | "text"
    nccl_version: str
    communicators: tuple[RasCommunicator, ...]
    # the answering process's local time, second resolution, no zone: orders reports of one
    # process, nothing more ("" in the text report, which has none)
    timestamp: str = ""
    cuda_runtime_version: int | None = None
    cuda_driver_version: int | None = None
    collection_time_s: float | None = None
    timeouts: int = 0  # RAS's own timeouts while gathering (a peer that did not answer)
    repaired: str = ""  # what was repaired before the JSON parsed ("" when nothing)
    missing_processes: tuple[RasProcess, ...] = ()  # text: no data from them at all
    dead_processes: tuple[RasProcess, ...] = ()  # text: considered dead
    groups: tuple[RasGroupRow, ...] = ()  # text: the communicator table

    def communicator(self, key_or_hash: str) -> RasCommunicator | None:
        for c in self.communicators:
            if key_or_hash in (c.key, c.hash):
                return c
        return None


class RasReportError(ValueError):
    """Text that is not a readable RAS report; the message says why, in one line."""
