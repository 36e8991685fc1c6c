"""What the tool collected about a job, per rank, before any reasoning (pure data).

Capture code fills these from files and processes; :mod:`moe_hang.analysis` turns them into a
:class:`~moe_hang.analysis.diagnosis.Diagnosis`. Tests build them from recorded fixtures. The
files' shapes are in docs/DESIGN.md §7; every reader here tolerates a field that is missing or
of the wrong type (a rank may die mid-write, a dump may come from another torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_hang.evidence.activity import Activity
from moe_hang.evidence.flight_recorder import Collective, FRDump, P2PEntry, PgStatus
from moe_hang.evidence.probe_records import Heartbeat, PostedRecord, as_float, as_int
from moe_hang.evidence.ras import RasEvidence
from moe_hang.evidence.routing import RouterCall
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import (
    Frame,
    Helper,
    ThreadStack,
    parse_probe_frames,
    traceback_frames,
)
from moe_hang.evidence.vocab import JobState


@dataclass
class RankError:
    """The Python exception that ended a rank: from the probe's ``error.json``, or the last
    ``[rankN]: SomeError: ...`` line of the job log (``source="job log"``).

    An exception re-raised by a wrapper that carries the original's traceback as text (torch's
    DataLoader: ``KeyError: Caught KeyError in DataLoader worker process 0.`` + ``Original
    Traceback ...``) is the original one (``evidence.errors.unwrap``): its type, message and
    frames (where it was raised, then the wrapper's own frames), and ``wrapped_by`` says what
    re-raised it."""

    type: str
    message: str = ""
    frames: list[Frame] = field(default_factory=list)  # innermost first
    time: float | None = None
    source: str = "probe"
    seen_at: int | None = None  # from the job log: the line its traceback starts on
    wrapped_by: str | None = None  # ``Type: message`` of the wrapper that re-raised it
    restart: int | None = None  # torchrun's restart count of the attempt it ended (0: first)
    # one that ended a thread of the rank, not the rank: that thread's name and id (as the
    # recorder's thread ids)
    thread: str | None = None
    thread_id: str | None = None

    @classmethod
    def parse(cls, data: Any) -> RankError | None:
        if not isinstance(data, dict):
            return None
        frames = parse_probe_frames(data.get("frames"))
        if not frames and isinstance(data.get("traceback"), list):
            frames = traceback_frames([str(x) for x in data["traceback"]])
        return cls(type=str(data.get("type") or "Error"), message=str(data.get("message", "")),
                   frames=frames, time=as_float(data.get("time")),
                   source=str(data.get("source", "probe")), restart=as_int(data.get("restart")),
                   thread=None if data.get("thread") is None else str(data["thread"]),
                   thread_id=None if data.get("thread_id") is None else str(data["thread_id"]))


@dataclass
class ProcessRecord:
    """One rank's process as the tool saw it at capture time (``processes.json``)."""

    pid: int | None = None
    host: str | None = None
    alive: bool | None = None
    exit_code: int | None = None  # negative: killed by that signal (torchrun's convention)
    progressed: bool | None = None  # did it move while we looked? None: not measured
    local_rank: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # allowlisted only
    note: str | None = None
    activity: Activity | None = None  # its counters over the sampling window (evidence.activity)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pid": self.pid, "host": self.host, "alive": self.alive,
                             "exit_code": self.exit_code}
        if self.progressed is not None:
            d["progressed"] = self.progressed
        if self.activity is not None:
            d["activity"] = self.activity.to_dict()
        if self.local_rank is not None:
            d["local_rank"] = self.local_rank
        if self.env:
            d["env"] = self.env
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def parse(cls, data: Any) -> ProcessRecord:
        if not isinstance(data, dict):
            return cls()
        alive = data.get("alive")
        progressed = data.get("progressed")
        env = data.get("env")
        return cls(pid=as_int(data.get("pid")), host=data.get("host") or None,
                   alive=bool(alive) if alive is not None else None,
                   exit_code=as_int(data.get("exit_code")),
                   progressed=bool(progressed) if progressed is not None else None,
                   local_rank=as_int(data.get("local_rank")),
                   env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict)
                   else {},
                   note=str(data["note"]) if data.get("note") else None,
                   activity=Activity.parse(data.get("activity")))


@dataclass
class ProcessTable:
    """``processes.json``: what the tool saw of the job's processes, written by every command
    that captures (repro, verify, watch, diagnose) in this one shape."""

    ranks: dict[int, ProcessRecord] = field(default_factory=dict)
    world_size: int | None = None
    job: JobState = JobState.STALLED
    job_exit_code: int | None = None
    agent_exit_code: int | None = None  # the launcher itself, when it died by a signal
    agent_pid: int | None = None
    target_pid: int | None = None
    notes: list[str] = field(default_factory=list)
    orphans: list[tuple[int, int]] = field(default_factory=list)  # (rank, pid) of non-ranks
    probe_errors: dict[int, str] = field(default_factory=dict)
    # watch found the ranks running without its probe and watched them by sampling
    sampled: bool = False
    # when the capture was made (wall clock, this host's): a rank's exception recorded later
    # was raised by the job's end that followed (the tool ending it), not by the hang
    captured_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"world_size": self.world_size, "job": self.job,
                             "job_exit_code": self.job_exit_code,
                             "agent_exit_code": self.agent_exit_code}
        if self.agent_pid is not None or self.target_pid is not None:
            d.update(agent_pid=self.agent_pid, target_pid=self.target_pid)
        d["ranks"] = {str(r): rec.to_dict() for r, rec in sorted(self.ranks.items())}
        if self.notes:
            d["notes"] = self.notes
        if self.orphans:
            d["orphans"] = [{"rank": r, "pid": p} for r, p in self.orphans]
        if self.probe_errors:
            d["probe_errors"] = {str(r): e for r, e in sorted(self.probe_errors.items())}
        if self.sampled:
            d["sampled"] = True
        if self.captured_at is not None:
            d["captured_at"] = self.captured_at
        return d

    @classmethod
    def parse(cls, data: Any) -> ProcessTable:
        """Tolerant: a missing or malformed file is an empty table."""
        if not isinstance(data, dict):
            return cls()
        ranks: dict[int, ProcessRecord] = {}
        raw = data.get("ranks")
        if isinstance(raw, dict):
            for k, v in raw.items():
                r = as_int(k)
                if r is not None:
                    ranks[r] = ProcessRecord.parse(v)
        orphans = [(int(o["rank"]), int(o["pid"])) for o in data.get("orphans") or []
                   if isinstance(o, dict) and as_int(o.get("rank")) is not None
                   and as_int(o.get("pid")) is not None]
        errs = data.get("probe_errors")
        return cls(ranks=ranks, world_size=as_int(data.get("world_size")),
                   job=JobState.parse(data.get("job")),
                   job_exit_code=as_int(data.get("job_exit_code")),
                   agent_exit_code=as_int(data.get("agent_exit_code")),
                   agent_pid=as_int(data.get("agent_pid")),
                   target_pid=as_int(data.get("target_pid")),
                   notes=[str(n) for n in data.get("notes") or []], orphans=orphans,
                   probe_errors={int(k): str(v) for k, v in errs.items()
                                 if as_int(k) is not None} if isinstance(errs, dict) else {},
                   sampled=data.get("sampled") is True,
                   captured_at=as_float(data.get("captured_at")))


@dataclass
class RankEvidence:
    rank: int
    pid: int | None = None
    host: str | None = None
    alive: bool | None = None  # None: unknown
    exit_code: int | None = None  # negative: killed by that signal (torchrun's convention)
    fr: FRDump | None = None
    fr_saved: bool = False  # ``fr`` is the probe's periodic save, older than its heartbeat
    fr_error: str | None = None
    threads: list[ThreadStack] | None = None
    stack_source: str | None = None  # py-spy | faulthandler | fatal | probe
    helpers: list[Helper] = field(default_factory=list)  # its own child processes, sampled
    stack_error: str | None = None
    progressed: bool | None = None  # did it move between two samples?
    activity: Activity | None = None  # its process's counters over the sampling window
    records: list[PostedRecord] = field(default_factory=list)  # the worker's posting log
    # the probe's posted log (evidence/posted_log.py): every collective the rank posted, as
    # its recorder had it, kept past its end (an abort, a kill); complete up to its last gasp
    # (``log_end`` says why it ended; None: a kill, or still running) or its last tick
    posted_log: list[Collective] = field(default_factory=list)
    posted_p2p: list[P2PEntry] = field(default_factory=list)
    log_gaps: list[tuple[int, int]] = field(default_factory=list)  # record ids lost, inclusive
    log_end: str | None = None
    log_status: dict[str, PgStatus] = field(default_factory=dict)  # its last counts, by group
    log_op_lead: dict[str, int] = field(default_factory=dict)  # gloo: FRDump.op_lead, its log's
    log_pg_names: dict[str, str] = field(default_factory=dict)  # FRDump.pg_names, its log's
    heartbeat: Heartbeat | None = None
    error: RankError | None = None  # a Python exception the rank recorded
    thread_errors: list[RankError] = field(default_factory=list)  # ones that ended a thread
    fatal: str | None = None  # faulthandler's fatal-signal text
    groups: dict[str, list[int]] | None = None  # pg name -> member ranks, from the probe
    # it raised and its probe holds it alive for the capture (multi-node watch): to the
    # analysis it has failed where it raised, whatever its process does meanwhile
    held: bool = False
    # its MoE routers' token counts per call, the last two steps (probe/routing.py)
    routing: list[RouterCall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SizeAbort:
    """gloo aborted a rank because a peer sent more bytes than it expected ("Received data size
    doesn't match expected size"); the byte counts when the log gives them."""

    received: int | None = None
    expected: int | None = None


@dataclass
class Unreached:
    """Ranks of a job that spans nodes whose watcher never answered (not started, killed,
    unreachable): nothing is known of them, so they are never blamed (docs/DESIGN.md §10).
    ``local_world`` and ``hosts`` (node index -> host) say where they run."""

    ranks: list[int]
    local_world: int | None = None
    hosts: dict[str, str] = field(default_factory=dict)
    # their nodes' captures exist but were not given (``analyze`` of one node's run
    # directory of a multi-node watch): the same unknown, for another reason
    not_given: bool = False


@dataclass
class Restarts:
    """torchrun restarted the worker group (``--max-restarts``): how many times, and what the
    ranks of the last failed attempt recorded of their exceptions before it was replaced (its
    number in each record: ``RankError.restart``)."""

    count: int
    errors: dict[int, RankError] = field(default_factory=dict)


@dataclass
class Evidence:
    ranks: dict[int, RankEvidence]
    world_size: int | None = None
    job: JobState = JobState.STALLED
    job_exit_code: int | None = None
    agent_exit_code: int | None = None  # the launcher itself, when it died by a signal
    root_cause_rank: int | None = None  # torchrun's "first observed failure"
    log_lines: list[str] = field(default_factory=list)  # for display only
    artifacts: str = ""
    size_abort: SizeAbort | None = None  # from the whole job log (see gloo_size_abort)
    unreached: Unreached | None = None  # ranks of other nodes no watcher answered for
    # a stall the watcher lived with (uncertain) and reported again once --hang-after passed:
    # its own words ("no progress on any rank for 300 s (--hang-after)")
    held: str | None = None
    # NCCL's RAS reports of the job (--ras FILE, or polled live): None when there are none
    ras: RasEvidence | None = None
    # watched by sampling: the probe was not in the ranks (their launch script dropped it)
    sampled: bool = False
    # torchrun restarted the worker group: None when it never did
    restarts: Restarts | None = None
    # what the job's source said of the capture's lines, read when it was made (None: not
    # read — torch's own dumps, a capture from before: nothing of the source is known)
    source: SourceFacts | None = None
