"""What a node publishes of its capture (:func:`capture_summary`), and the other nodes'
summaries back as evidence beside this node's own (:func:`merge_remote`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moe_hang.capture.source import record
from moe_hang.evidence.errors import unwrap
from moe_hang.evidence.flight_recorder import DEFAULT_PG, Collective, FRDump, PgStatus
from moe_hang.evidence.flight_recorder import load as load_dump
from moe_hang.evidence.load import dumped_threads, load_capture, read_source
from moe_hang.evidence.model import Evidence, RankError, RankEvidence, SizeAbort
from moe_hang.evidence.ops import normalise_dtype, normalise_op
from moe_hang.evidence.posted_log import PostedLog, read_posted_log
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import (
    Frame,
    ThreadStack,
    collective_of,
    is_library_frame,
    main_thread,
    thread_number,
)
from moe_hang.evidence.torchrun_log import gloo_size_abort, parse_torchrun_failures, read_job_log
from moe_hang.evidence.vocab import RankState
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import coord
from moe_hang.runtime.coord import NodeSummary, PendingCollective, RankSummary

HISTORY_PER_GROUP = 256  # a capture summary: each rank's last collectives per group (several
# steps of an FSDP2 model: what aligning two ranks' histories, and "this collective always had
# this shape", need) ...
MAX_HISTORY = 1024  # ... and at most this many in all per rank: the summary crosses the store
MAX_USER_FRAMES = 12
MAX_STACK_FRAMES = 24  # a summary's main-thread stack, as a heartbeat's sample is cut


def history_of(dump: FRDump | None, per_group: int = HISTORY_PER_GROUP, *,
               log: PostedLog | None = None, dead: bool = False
               ) -> tuple[list[PendingCollective], dict[str, list[int]]]:
    """A rank's recent collectives for its capture summary: the last ``per_group`` of each
    group (at most ``MAX_HISTORY`` in all; user frames only, the posting thread's name), and
    each group's status by name. From its Flight Recorder dump at capture and, before it, its
    posted log (the dump is a ring: the log goes further back); past it too where the dump
    cannot be the rank's last word: there is none (gloo aborted it, it was killed), or the
    rank is ``dead`` (it went on after the dump)."""
    by_id: dict[int, Collective] = {}
    loose: list[Collective] = []
    top = max((c.record_id for c in dump.entries if c.record_id is not None), default=-1) \
        if dump is not None else None
    for c in log.collectives if log is not None else []:
        if c.record_id is not None and (top is None or dead or c.record_id <= top):
            by_id[c.record_id] = c
    for c in dump.entries if dump is not None else []:  # as of capture: it wins ...
        rid = c.record_id
        if rid is None:
            loose.append(c)
            continue
        old = by_id.get(rid)
        if old is not None and old.frames and not c.frames:
            # ... but for the frames a dump taken without them left out, which the log kept
            # (as the timeline merges the two)
            c = replace(c, frames=old.frames, thread_id=c.thread_id or old.thread_id,
                        thread_name=c.thread_name or old.thread_name)
        by_id[rid] = c
    groups: dict[str, list[Collective]] = {}
    for c in [*by_id.values(), *loose]:
        groups.setdefault(c.pg, []).append(c)
    kept = [c for entries in groups.values()
            for c in sorted(entries, key=lambda c: c.seq)[-per_group:]]
    if len(kept) > MAX_HISTORY:  # the newest, whichever group they are on
        kept = sorted(kept, key=lambda c: (c.time_created_ns or 0, c.record_id or 0)
                      )[-MAX_HISTORY:]
    kept.sort(key=lambda c: (c.pg, c.seq))
    out = [PendingCollective(
        op=c.raw_op or c.op, seq=c.seq, pg_id=c.pg, pg=c.pg, pg_desc=c.pg_desc or None,
        input_sizes=c.input_sizes, output_sizes=c.output_sizes, dtypes=c.dtypes,
        t_ns=c.time_created_ns, completed=c.completed,
        frames=[f"{f.file}:{f.line}:{f.function}" for f in c.frames
                if not is_library_frame(f)][:MAX_USER_FRAMES], thread=c.thread_name,
        thread_id=c.thread_id)
        for c in kept]
    pg_status = dump.pg_status if dump is not None else (log.status if log is not None else {})
    status = {pg: [st.enqueued, st.completed] for pg, st in pg_status.items()}
    return out, status


def raw_heartbeats(layout: RunLayout) -> dict[int, dict[str, Any]]:
    """The ranks' heartbeats as the probe wrote them (what summaries are made of)."""
    out: dict[int, dict[str, Any]] = {}
    for p in layout.files_of(RankFiles.HEARTBEAT):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
    return out


def capture_summary(layout: RunLayout, node: str, host: str | None, *,
                    moving: Mapping[int, bool] | None,
                    alive: Mapping[int, bool] | None) -> NodeSummary:
    """What a node publishes of its capture: its ranks' heartbeats, their recent collectives
    from the Flight Recorder dumps just taken and their posted logs, the groups they are
    members of."""
    s = coord.summarize_heartbeats(raw_heartbeats(layout), node=node, host=host,
                                   moving=moving, alive=alive, kind="capture")
    for r in s.ranks:
        dump = _probe_dump(layout.rank(r.rank))  # its stack file, read once
        _history(r, layout.rank(r.rank), dump)
        r.error = error_of(layout.rank(r.rank).error)
        if not r.held and r.error is None:
            _fresher_stack(r, dump)
        r.threads = [t.thread_id for t in dump.threads if t.thread_id] if dump else []
        with contextlib.suppress(OSError, UnicodeDecodeError):
            fatal = layout.rank(r.rank).fatal
            if not r.held and fatal.exists():
                r.fatal = fatal.read_text()[:coord.FATAL_CHARS] or None
    groups: dict[str, set[int]] = {}
    for p in layout.files_of(RankFiles.GROUPS):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for pg, rs in json.loads(p.read_text()).items():
                groups.setdefault(str(pg), set()).update(int(r) for r in rs)
    s.groups = {pg: sorted(rs) for pg, rs in groups.items()}
    # the log's bounded tail, as the capture's own loader reads it (a long job's log is big)
    log_text = read_job_log(layout.job_log)
    if (abort := gloo_size_abort(log_text)) is not None:
        s.size_abort = [abort.received, abort.expected]
    # a rank that died: torchrun's failure report says of what (SIGKILL: -9), as this node's
    # own capture reads it
    failures = parse_torchrun_failures(log_text)
    for r in s.ranks:
        if r.exit_code is None and r.rank in failures \
                and r.pid in (None, failures[r.rank][1]):
            r.exit_code = failures[r.rank][0]
    s.source = _source_of(layout)
    return s


def _source_of(layout: RunLayout) -> dict[str, Any] | None:
    """What the job's source says of this node's ranks' lines: read here, where the files
    are (the analysing node may have none of them); as stored, where the capture has it."""
    stored = read_source(layout)
    if stored is None:
        with contextlib.suppress(Exception):  # a capture cut short: its frames say less
            stored = record(load_capture(layout.root))
    return stored.to_dict() if stored is not None and stored.files else None


def _history(r: RankSummary, files: RankFiles, probe: _ProbeDump | None) -> None:
    """Its collectives from its dump at capture and its posted log (an aborted or killed
    rank has only the log); a dump cut short, or a log unreadable: the other, or the beat."""
    dump = log = None
    with contextlib.suppress(Exception):
        if files.fr.exists():
            dump = load_dump(files.fr)
    with contextlib.suppress(Exception):
        log = read_posted_log(files.posted)
    if dump is None and (log is None or not log.collectives):
        return
    with contextlib.suppress(Exception):
        r.history, r.fr_status = history_of(dump, log=log,
                                            dead=r.state == RankState.EXITED)
        _placed_by_poster(r.history, probe)


def _placed_by_poster(history: list[PendingCollective], dump: _ProbeDump | None) -> None:
    """A pending collective with no frames of its own, whose posting thread is inside that
    same op in the probe's dump taken after it was posted: that thread's lines are where it
    was posted. The analysing node has only the main thread's sample of this rank, and a
    metrics thread's all-reduce on a group of its own is not at the main thread's line."""
    if dump is None or (t := dump.time) is None:
        return
    threads = {n: th for th in dump.threads
               if (n := thread_number(th.thread_id)) is not None}
    for h in history:
        n = thread_number(h.thread_id) if h.thread_id else None
        th = threads.get(n) if n is not None else None
        if th is None or h.frames or h.completed is not False or h.t_ns is None \
                or t * 1e9 < h.t_ns or collective_of(th.frames)[0] != normalise_op(h.op):
            continue
        h.frames = [f"{f.file}:{f.line}:{f.function}" for f in th.frames
                    if not is_library_frame(f)][:MAX_USER_FRAMES]


def _fresher_stack(r: RankSummary, dump: _ProbeDump | None) -> None:
    """The stack of a dump the probe wrote after the rank's last beat (torchrun's SIGTERM,
    a dump asked for) in place of that beat's sample: a fast loop goes through several
    collectives between two beats, and the capture's own loader reads the dump, so the
    node's summary must say the same (fuzz 4071993 job 44: a beat from init_process_group,
    a SIGTERM dump a tenth of a second later in the step's all-reduce)."""
    if dump is None or (t := dump.time) is None:
        return
    if dump.reason == "exception" or (r.beat_time is not None and t <= r.beat_time):
        return
    main = main_thread(dump.threads)
    if main is None or not main.frames:
        return
    r.stack = [f"{f.file}:{f.line}:{f.function}" for f in main.frames][:MAX_STACK_FRAMES]
    r.callsite = next((f"{f.file}:{f.line}:{f.function}" for f in main.frames
                       if not is_library_frame(f)), None)


@dataclass(frozen=True)
class _ProbeDump:
    """The probe's last dump of every thread (``stack.txt``), parsed once: when it was
    written and why (its marker; None: no marker), and the threads."""

    time: float | None
    reason: object
    threads: list[ThreadStack]


def _probe_dump(files: RankFiles) -> _ProbeDump | None:
    try:
        text = files.stack.read_text(errors="replace")
    except OSError:
        return None
    try:
        marker = json.loads(files.dump_marker.read_text())
    except (OSError, ValueError):
        marker = None
    t = marker.get("time") if isinstance(marker, dict) else None
    return _ProbeDump(float(t) if isinstance(t, (int, float)) else None,
                      marker.get("reason") if isinstance(marker, dict) else None,
                      dumped_threads(text))


def error_of(path: Path) -> dict[str, Any] | None:
    """A rank's exception record (``error.json``), compact: what the analysing node needs to
    name it the root cause (type, first line, the innermost frames, time, attempt)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    frames = [f"{f[0]}:{f[1]}:{f[2]}" for f in d.get("frames") or []
              if isinstance(f, list) and len(f) >= 3][:MAX_USER_FRAMES * 2]
    out: dict[str, Any] = {"type": str(d.get("type") or "Error"),
                           "message": str(d.get("message", ""))[:500], "frames": frames}
    for k in ("time", "restart"):
        if isinstance(d.get(k), (int, float)):
            out[k] = d[k]
    return out


def _error(r: RankSummary) -> RankError | None:
    if not r.error:
        return None
    frames = [Frame(str(file), int(line), str(fn))
              for file, line, fn in (coord.parse_frame(str(f)) for f in r.error.get("frames", []))]
    return unwrap(RankError(type=str(r.error.get("type") or "Error"),
                            message=str(r.error.get("message", "")), frames=frames,
                            time=_num(r.error.get("time")), source="probe (remote summary)",
                            restart=_whole(r.error.get("restart"))))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None


def _whole(v: Any) -> int | None:
    return v if isinstance(v, int) else None


def _fr_of(r: RankSummary) -> FRDump | None:
    """What a remote rank's recorder said, back as a dump (the richest evidence there is of
    it): its recent collectives by group name, with the groups' status."""
    if not r.history and not r.fr_status:
        return None
    entries = []
    for h in r.history:
        frames = [Frame(str(file), int(line), str(fn))
                  for file, line, fn in (coord.parse_frame(f) for f in h.frames)]
        entries.append(Collective(
            pg=h.pg or h.pg_id, seq=h.seq, op=normalise_op(h.op), raw_op=h.op,
            pg_desc=h.pg_desc or "", input_sizes=h.input_sizes, output_sizes=h.output_sizes,
            dtypes=[normalise_dtype(d) for d in h.dtypes], time_created_ns=h.t_ns,
            frames=frames, completed=h.completed, thread_name=h.thread,
            thread_id=h.thread_id))
    status = {pg: PgStatus(v[0], v[1]) for pg, v in r.fr_status.items()}
    return FRDump(entries=entries, pg_status=status, backend="remote summary")


def merge_remote(ev: Evidence, summaries: Mapping[str, NodeSummary]) -> list[int]:
    """The ranks of other nodes, from their watchers' summaries, as evidence beside this
    node's own (a rank with evidence of its own is kept). Returns the ranks added."""
    added: list[int] = []
    for _node, s in sorted(summaries.items()):
        hbs = coord.to_heartbeats([s])
        for r in s.ranks:
            if r.rank in ev.ranks:
                continue
            hb = Heartbeat.parse(hbs[r.rank])
            if hb is not None and hb.pg_status is not None:
                # a group is named by id in a heartbeat; only its pending entries (and the
                # default group, id 0 = name 0) say which name: an id of unknown name could
                # read as another group of the same number on this node
                named = {str(e.get("pg_id")) for e in hb.pending} | {DEFAULT_PG}
                hb.pg_status = {k: v for k, v in hb.pg_status.items() if k in named}
            err = _error(r)
            ev.ranks[r.rank] = RankEvidence(
                rank=r.rank, pid=r.pid, host=s.host, alive=r.state != RankState.EXITED,
                exit_code=r.exit_code, heartbeat=hb, progressed=r.moving, fr=_fr_of(r),
                groups={k: list(v) for k, v in s.groups.items()} or None, error=err,
                live_threads=list(r.threads) or None)
            if r.held and err is not None and err.frames:
                # held for the capture by its probe: where it raised is its stack
                ev.ranks[r.rank].threads = [ThreadStack("MainThread", err.frames, is_main=True)]
                ev.ranks[r.rank].stack_source = "exception traceback (held for the capture)"
                ev.ranks[r.rank].held = True
            if r.fatal and not ev.ranks[r.rank].held:
                ev.ranks[r.rank].fatal = r.fatal  # where the signal ended it (faulthandler)
            added.append(r.rank)
        if s.size_abort is not None and ev.size_abort is None:
            ev.size_abort = SizeAbort(*s.size_abort)  # the dead rank's node logged it
        if s.source:  # what that node read of its ranks' source
            if ev.source is None:
                ev.source = SourceFacts()
            ev.source.merge(SourceFacts.from_dict(s.source))
    return sorted(added)
