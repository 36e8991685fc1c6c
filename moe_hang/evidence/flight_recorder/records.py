"""What a Flight Recorder dump becomes (:class:`FRDump` of :class:`Collective` s and
:class:`P2PEntry` s, each group's :class:`PgStatus`), and the error for a file that is not one
(:mod:`.load` reads them) — pure."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import Any

from moe_hang.evidence.stacks import Frame

DEFAULT_PG = "0"  # the default process group's name in Flight Recorder and the probe
DEFAULT_CONTEXT = 4  # completed entries kept per group when windowing (history for the verdict)
# completed entries kept over every rank's dumps together: the history the verdict reads (what
# earlier steps posted, from where) is as long as this allows — a small job's whole, 8192
# ranks' last DEFAULT_CONTEXT per group (the post-mortem benchmark's scale)
HISTORY_BUDGET = 8192 * DEFAULT_CONTEXT

# an entry's state as torch's recorder writes it, least advanced first: ``scheduled``
# (enqueued), ``started`` (its start event fired: the kernel runs; only with start events,
# i.e. TORCH_NCCL_ENABLE_TIMING=1 or TORCH_NCCL_DESYNC_DEBUG), ``completed``
STATES = ("scheduled", "started", "completed")


@dataclass
class Collective:
    pg: str  # process group name, identical on every member rank ("0" = default_pg)
    seq: int  # collective_seq_id within that group
    op: str  # normalised: all_gather, all_reduce, reduce_scatter, all_to_all, barrier, ...
    raw_op: str = ""  # profiling_name as recorded, e.g. "gloo:all_gather"
    pg_desc: str = ""
    input_sizes: list[list[int]] = field(default_factory=list)
    output_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    time_created_ns: int | None = None
    frames: list[Frame] = field(default_factory=list)  # innermost first
    completed: bool | None = None
    source: str = "flight_recorder"  # flight_recorder | probe | heartbeat | posted_log
    name: str | None = None  # the probe's step name (gather_tokens, combine, ...)
    phase: str | None = None  # forward | backward, when known
    tag: str | None = None  # the probe's identity of the collective (layer1.expert2)
    autograd_fn: str | None = None  # the autograd.Function whose backward posted it
    record_id: int | None = None  # position in the rank's recorder (program order, all groups)
    coalesced: int = 0  # ops merged into this one (a coalesced group); 0: a single op
    state: str | None = None  # one of STATES as recorded (None: not recorded, or a probe's)
    # when the recorder's watchdog *discovered* the start / the completion (time_discovered_*:
    # not the kernel's own times); None when not recorded (JSON writes a missing one as 0)
    time_started_ns: int | None = None
    time_completed_ns: int | None = None
    duration_ms: float | None = None  # the kernel's time between its events (timing only)
    # the thread that posted it (torch >= 2.8): its id (decimal pthread id, what Python's
    # threading.get_ident() says) and name (a recorder dump: the OS name, "python" for every
    # Python thread; the probe's posted log: the Python thread's own name where it knew it)
    thread_id: str | None = None
    thread_name: str | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # positional: half the unpickling time of the default (workers send thousands)
        return (Collective, _COLLECTIVE_FIELDS(self))

    @property
    def started(self) -> bool:
        """Its kernel is known to have started (``started`` or ``completed`` with a start
        time): only dumps with start events can say so."""
        return self.state == "started" or self.time_started_ns is not None


@dataclass
class P2PEntry:
    """One send or recv (NCCL only: gloo records none)."""

    op: str  # send | recv
    peer: int | None  # the other side as a *global* rank (None: not mappable)
    pg: str
    p2p_seq: int  # p2p_seq_id within the group (per rank, +1 per p2p op)
    completed: bool | None
    seq: int = -1  # the group's collective_seq_id at the time (p2p ops do not advance it)
    local_peer: int | None = None  # as recorded, group-local
    pg_desc: str = ""
    input_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    time_created_ns: int | None = None
    record_id: int | None = None
    frames: list[Frame] = field(default_factory=list)
    batched: bool = False  # part of a batch_isend_irecv (closed by nccl:coalesced)
    state: str | None = None  # as Collective's
    time_started_ns: int | None = None
    time_completed_ns: int | None = None
    duration_ms: float | None = None
    thread_id: str | None = None  # as Collective's
    thread_name: str | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (P2PEntry, _P2P_FIELDS(self))


_COLLECTIVE_FIELDS = attrgetter(*(f.name for f in fields(Collective)))
_P2P_FIELDS = attrgetter(*(f.name for f in fields(P2PEntry)))


@dataclass(frozen=True)
class PgStatus:
    """A process group's last enqueued, last completed and last started sequence number (-1:
    none; ``started`` is -1 too where the recorder has no start events, i.e. without
    TORCH_NCCL_ENABLE_TIMING=1, and in dumps older than ``last_started_collective``)."""

    enqueued: int
    completed: int
    started: int = -1

    @property
    def pending(self) -> bool:
        return self.enqueued > self.completed


@dataclass
class Window:
    """How much of the dump was kept (``context`` windowing)."""

    total: int  # entries in the dump
    kept: int  # entries turned into records
    first_record_id: int | None = None  # > 0: the ring buffer wrapped (or was reset)


@dataclass
class FRDump:
    entries: list[Collective]  # collectives only, record order
    pg_status: dict[str, PgStatus]  # by process-group name, in collective sequence numbers
    pg_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # group-local order
    version: str = ""  # the dump's format version ("2.10"), not torch's
    backend: str = ""  # nccl | gloo | ... (from profiling names or the layout)
    source: Path | None = None  # the file it was read from
    p2p: list[P2PEntry] = field(default_factory=list)
    pg_desc: dict[str, str] = field(default_factory=dict)  # group name -> desc
    lib_version: str = ""  # NCCL's version; "" for gloo
    window: Window | None = None
    # gloo: by group name, how many ops (send/recv: gloo's op ids count them, its seqs do
    # not) its newest collective's op id is ahead of its seq — what a gloo count of ops (a
    # heartbeat's) is ahead of the collectives, as of that entry
    op_lead: dict[str, int] = field(default_factory=dict)
    # the process's own group ids (its entries' and pg_status's ``pg_id``) -> group names: a
    # process numbers only the groups it belongs to, so on a mesh id "2" may be group "6"
    pg_names: dict[str, str] = field(default_factory=dict)

    @property
    def timing(self) -> bool:
        """The recorder had start events (TORCH_NCCL_ENABLE_TIMING=1): an entry has a start
        time, a ``started`` state or a duration, or a group a last started collective."""
        return (any(c.started or c.duration_ms is not None for c in self.entries)
                or any(p.state == "started" or p.time_started_ns is not None
                       for p in self.p2p)
                or any(s.started >= 0 for s in self.pg_status.values()))

    def by_pg(self) -> dict[str, list[Collective]]:
        out: dict[str, list[Collective]] = {}
        for e in self.entries:
            out.setdefault(e.pg, []).append(e)
        for v in out.values():
            v.sort(key=lambda c: c.seq)
        return out


class DumpError(ValueError):
    """A file that is not a readable Flight Recorder dump (the message says why)."""
