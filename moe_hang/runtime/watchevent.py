"""What a watch is told and tells: its settings (:class:`WatchSettings`), why
:meth:`~moe_hang.runtime.monitor.Monitor.run` returned (:class:`EventKind`, :class:`WatchEvent`),
what one sampling round saw of a rank (:class:`RoundRank`), and what a heartbeat says of the
job as a whole (its onset, its world) — records, no processes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang.evidence.activity import Activity
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import collective_of
from moe_hang.evidence.vocab import JobState, StrEnum
from moe_hang.settings import Settings

Phase = Callable[[str], None]  # what a command shows as its live phase ("capturing stacks")


@dataclass
class WatchSettings:
    probe_dir: Path
    world: int | None
    stall_s: float
    startup_timeout_s: float = 180.0
    poll_s: float = 0.1
    # walking the process tree (psutil over /proc) is the loop's main cost: not every poll
    refresh_s: float = 1.0
    # after a rank failed, how long torchrun may take to end the others before we do
    teardown_wait_s: float = 15.0
    desync_fast_path: bool = True
    # say so (once per episode) when ranks wait while another computes; keep watching
    straggler_notice: bool = False
    # nothing moves and no collective is pending (a deadlock outside torch.distributed, a
    # stuck data loader): stalled after this long (default max(30 s, 3 × stall_s))
    idle_stall_s: float | None = None
    # a stall the command lives with (uncertain: a rank outside collectives may only be
    # slow) is reported again, as final, after this long; 0: never
    hang_after_s: float = 0.0
    # ranks of the job that run this long with no heartbeat: the probe is not in them (the
    # job's script replaced PYTHONPATH, ...): watch them by sampling (a probe beats within a
    # second of its interpreter's start)
    probe_grace_s: float = 5.0
    # look for ranks that run without the probe (watch); repro's worker always has it
    watch_unprobed: bool = False
    # torchrun's --max-restarts: a worker group it restarts after a failure is no failed job
    max_restarts: int = 0
    # ... and how long it may take to start the next attempt's ranks (a re-rendezvous)
    restart_wait_s: float = 120.0
    # the tool's own waits (a heartbeat gone stale, ranks settled): the command's Settings
    timings: Settings = field(default_factory=Settings)


class EventKind(StrEnum):
    """Why :meth:`Monitor.run` returned — and, from a capture request, what a capture was for
    (a multi-node request's reason starts with it)."""

    RUNNING = "running"  # nothing happened yet
    COMPLETED = "completed"  # the launcher exited 0
    FAILED = "failed"  # it exited non-zero, or a rank died and it did not end the job
    STALLED = "stalled"  # nothing moved for --stall s while a rank waits in a collective
    DESYNC = "desync"  # heartbeats show ranks pending at one seq, mismatched
    STARTUP_TIMEOUT = "startup_timeout"
    REQUESTED = "requested"  # a capture was asked for (SIGUSR1, another node's request)
    RESUMED = "resumed"  # a rank moved after a stall the command lived with
    FINAL = "final"  # that held stall, reported again once --hang-after passed
    DIAGNOSE = "diagnose"  # `moe-hang diagnose` on another node asked for a capture

    @property
    def job(self) -> JobState:
        """What such an event makes of the job, for its evidence."""
        return _JOB_OF.get(self, JobState.RUNNING)


_JOB_OF = {EventKind.COMPLETED: JobState.COMPLETED, EventKind.FAILED: JobState.FAILED,
           EventKind.STARTUP_TIMEOUT: JobState.FAILED, EventKind.STALLED: JobState.STALLED,
           EventKind.FINAL: JobState.STALLED, EventKind.DESYNC: JobState.DESYNC}
# frozen by construction when captured: nothing moved for --stall s, or it cannot move
FROZEN = (EventKind.STALLED, EventKind.DESYNC, EventKind.FINAL)
# a capture on demand: nothing is ended after it
ON_DEMAND = (EventKind.REQUESTED, EventKind.DIAGNOSE)


@dataclass
class WatchEvent:
    """What :meth:`Monitor.run` saw when it returned (it keeps filling the same object)."""

    kind: EventKind
    returncode: int | None = None
    reason: str = ""
    rank_pids: dict[int, int] = field(default_factory=dict)
    dead_ranks: dict[int, float] = field(default_factory=dict)
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)
    t_start: float = 0.0
    t_up: float | None = None
    t_detect: float | None = None
    onset_ns: int | None = None
    # ranks left running after the agent died: did each move while we captured it?
    progressed: dict[int, bool] = field(default_factory=dict)
    stalled_for: float = 0.0  # resumed: how long nothing moved
    # watched by sampling (no probe in the ranks): what the ranks were started with, and each
    # rank's counters over the last sampling window
    sampled: bool = False
    world: int | None = None
    local_world: int | None = None
    activity: dict[int, Activity] = field(default_factory=dict)
    restarts: int = 0  # how many times torchrun restarted the worker group
    held: list[int] = field(default_factory=list)  # ranks that raised, held for the capture

    def ranks(self) -> list[int]:
        """Every rank seen: by its heartbeat, or by sampling."""
        return sorted(set(self.heartbeats) | set(self.rank_pids))

    def world_size(self) -> int | None:
        return world_of(self.heartbeats) or self.world


@dataclass(frozen=True)
class RoundRank:
    """What one sampling round saw of a rank (watch by sampling): read from its window as
    ``diagnose`` reads it (commands/sampling.py)."""

    moved: bool | None  # by its stacks, CPU and counters; None: nothing readable
    fingerprint: Any = None  # its main thread's frames in the last sample
    in_collective: bool = False
    activity: Activity | None = None
    error: str | None = None  # why its stack could not be read


# pids by rank -> what a window over them saw (bounded: py-spy's own timeout)
Sampler = Callable[[dict[int, int]], dict[int, RoundRank]]


def onset_ns(heartbeats: dict[int, Heartbeat]) -> int | None:
    """Creation time of the oldest collective still pending anywhere (the hang's onset)."""
    times = [int(e["time_created_ns"]) for hb in heartbeats.values()
             for e in hb.pending if isinstance(e.get("time_created_ns"), (int, float))]
    return min(times) if times else None


def world_of(hbs: dict[int, Heartbeat]) -> int | None:
    """WORLD_SIZE as the ranks report it."""
    return next((hb.world for hb in hbs.values() if hb.world), None)


def in_collective(hb: Heartbeat) -> bool:
    """The recorder has a collective of this rank pending, or its main thread is inside
    ``torch.distributed``."""
    return hb.has_pending() or collective_of(hb.frames())[0] is not None
