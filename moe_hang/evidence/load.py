"""Read a capture directory back into :class:`~moe_hang.evidence.model.Evidence`.

The layout is the same for repro, diagnose and watch (:mod:`moe_hang.probe.layout`), so
``analyze`` can merge any of them. Anything unreadable (a rank died while writing it) is
reported on that rank and skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.errors import log_tracebacks, unwrap, with_original
from moe_hang.evidence.flight_recorder import DEFAULT_PG
from moe_hang.evidence.flight_recorder.parse_entry import RankLists
from moe_hang.evidence.model import Evidence, ProcessTable, RankError, RankEvidence, Restarts
from moe_hang.evidence.posted_log import read_posted_log
from moe_hang.evidence.probe_records import Heartbeat, PostedRecord
from moe_hang.evidence.ras_files import attach_run_ras
from moe_hang.evidence.routing import read_routing
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import (
    Helper,
    ThreadStack,
    is_tool_frame,
    main_thread,
    parse_faulthandler,
    parse_pyspy,
)
from moe_hang.evidence.torchrun_log import (
    gloo_size_abort,
    notable_log_lines,
    parse_torchrun_failures,
    rank_errors_from_log,
    read_job_log,
    torchrun_root_cause,
)
from moe_hang.evidence.vocab import JobState
from moe_hang.probe.layout import RankFiles, RunLayout


def _read_json(path: Path, ev: RankEvidence, what: str) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        ev.notes.append(f"{what} unreadable ({type(exc).__name__})")
        return None


def read_processes(layout: RunLayout) -> ProcessTable:
    """processes.json, or an empty table when it is missing, unreadable or malformed."""
    try:
        return ProcessTable.parse(json.loads(layout.processes.read_text()))
    except (OSError, ValueError, RecursionError):
        return ProcessTable()


def load_rank(layout: RunLayout, rank: int, lists: RankLists | None = None) -> RankEvidence:
    """``lists``: shared by the dumps of one load (they repeat the same group lists)."""
    files = layout.rank(rank)
    ev = RankEvidence(rank=rank)
    hb = Heartbeat.parse(_read_json(files.heartbeat, ev, "heartbeat"))
    if hb is not None:
        ev.heartbeat = hb
        ev.pid = hb.pid
        ev.host = hb.host
    if files.fr.exists():
        try:
            ev.fr = fr.load(files.fr, lists=lists)
        except Exception as exc:
            ev.fr_error = f"{type(exc).__name__}: {exc}"[:160]
    elif files.fr_saved.exists():
        # no dump at capture (gloo aborted it from a C++ thread): the recorder as its probe
        # saved it a few seconds before; its heartbeat's counts say how far it got since
        try:
            ev.fr, ev.fr_saved = fr.load(files.fr_saved, lists=lists), True
            ev.notes.append("its recorder as the probe last saved it (it left no dump)")
        except Exception as exc:
            ev.fr_error = f"saved recorder: {type(exc).__name__}: {exc}"[:160]
    if files.tokens.exists():
        bad = 0
        for line in files.tokens.read_text(errors="replace").splitlines():
            try:
                rec = PostedRecord.parse(json.loads(line), DEFAULT_PG)
            except (ValueError, RecursionError):
                rec = None
            if rec is not None:
                ev.records.append(rec)
            else:
                bad += 1  # the last line of a rank that died mid-write
        if bad:
            ev.notes.append(f"{bad} unreadable line(s) in its token log")
    if files.routing.exists():
        got = read_routing(files.routing)
        ev.routing = got.calls
        if got.bad:
            ev.notes.append(f"{got.bad} unreadable line(s) in its routing log")
    log = read_posted_log(files.posted)
    if log is not None:
        ev.posted_log, ev.posted_p2p, ev.log_gaps, ev.log_end, ev.log_status = (
            log.collectives, log.p2p, log.gaps, log.end, log.status)
        ev.log_op_lead, ev.log_pg_names = log.op_lead, log.pg_names
        ev.notes.extend(log.notes)
    recorded = RankError.parse(_read_json(files.error, ev, "error record"))
    ev.error = unwrap(recorded) if recorded is not None else None
    threads = _read_json(files.thread_errors, ev, "thread error record")
    ev.thread_errors = [e for x in threads if (e := RankError.parse(x)) is not None] \
        if isinstance(threads, list) else []
    groups = _read_json(files.groups, ev, "process-group list")
    if isinstance(groups, dict):
        ev.groups = {str(k): [x for x in v if isinstance(x, int)] for k, v in groups.items()
                     if isinstance(v, list)}
    if files.fatal.exists():
        text = files.fatal.read_text(errors="replace")
        if text.strip():
            ev.fatal = text
    _load_stacks(ev, files)
    return ev


def _load_helpers(ev: RankEvidence, files: RankFiles) -> None:
    """py-spy of the rank's own child processes, where the capture took them."""
    try:
        raw = json.loads(files.helpers.read_text()) if files.helpers.exists() else []
    except (OSError, ValueError, RecursionError):
        ev.notes.append("its helpers' stacks unreadable")
        return
    for h in raw if isinstance(raw, list) else []:
        try:
            threads = parse_pyspy(h["stack"])
            main = main_thread(threads)
            ev.helpers.append(Helper(int(h["pid"]), str(h.get("name") or ""), threads,
                                     bool(main.active) if main is not None else None))
        except (KeyError, TypeError, ValueError):
            continue


def _load_stacks(ev: RankEvidence, files: RankFiles) -> None:
    _load_helpers(ev, files)
    if ev.heartbeat is not None and ev.heartbeat.held and ev.error is not None \
            and ev.error.frames:
        # it raised and its probe holds it for the capture (multi-node watch): where it is
        # now is the probe's wait; where it raised is its stack
        ev.threads = [ThreadStack("MainThread", ev.error.frames, is_main=True)]
        ev.stack_source = "exception traceback (held for the capture)"
        ev.held = True
        return
    if files.pyspy.exists():
        try:
            ev.threads = parse_pyspy(json.loads(files.pyspy.read_text()))
            ev.stack_source = "py-spy"
            return
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as exc:
            ev.notes.append(f"py-spy output unreadable ({type(exc).__name__})")
    if files.pyspy_error.exists():
        ev.stack_error = files.pyspy_error.read_text(errors="replace").strip()[:200] or None
    if ev.fatal:
        threads = parse_faulthandler(ev.fatal)
        # gloo's abort runs the probe's terminate handler in its I/O thread: a thread of the
        # probe's frames alone, none of the rank's work
        ev.threads = [t for t in threads
                      if not (t.frames and all(is_tool_frame(f) for f in t.frames))] or threads
        ev.stack_source = "faulthandler (fatal signal)"
        return
    marker = _read_json(files.dump_marker, ev, "dump marker")
    reason = marker.get("reason") if isinstance(marker, dict) else None
    # a rank that raised: its traceback says where, not the dump of its teardown (torchrun's
    # SIGTERM reaches it on the way out); only a dump we asked for while it lived is fresher
    raised = ev.error is not None and bool(ev.error.frames) and reason != "request"
    if files.stack.exists() and reason != "exception" and not raised:
        ev.threads = dumped_threads(files.stack.read_text(errors="replace"))
        ev.stack_source = f"faulthandler ({reason or 'dump'})"
        return
    if ev.error is not None and ev.error.frames:
        ev.threads = [ThreadStack("MainThread", ev.error.frames, is_main=True)]
        ev.stack_source = "exception traceback"


def dumped_threads(text: str) -> list[ThreadStack]:
    """The threads of a probe's dump (``rank*.stack.txt``): the dumping thread is the
    probe's, the rank's own work is on the main thread."""
    threads = parse_faulthandler(text)
    return [t for t in threads if not _is_probe_thread(t)] or threads


def _same_error(recorded: RankError, logged: RankError | None) -> bool:
    """The job log's copy of an exception the probe recorded (its first line)."""
    return logged is not None and logged.type.rsplit(".", 1)[-1] == recorded.type and \
        logged.message.strip().startswith(recorded.message.strip()[:200])


def _is_probe_thread(t: ThreadStack) -> bool:
    return any(is_tool_frame(f) for f in t.frames)


def rank_numbers(layout: RunLayout, procs: ProcessTable | None = None) -> list[int]:
    """Every rank with a file in the capture or an entry in processes.json."""
    table = read_processes(layout) if procs is None else procs
    return sorted(layout.rank_numbers() | set(table.ranks))


def load_capture(root: Path, *, world: int | None = None, job: JobState | None = None,
                 log_text: str | None = None, lists: RankLists | None = None) -> Evidence:
    """Evidence from one capture directory (one node, or a whole single-node job).
    ``log_text``: the job log when the caller has already read it; ``lists``: the group
    lists already parsed (several nodes' captures of one job)."""
    layout = RunLayout(Path(root))
    table = read_processes(layout)
    if log_text is None:
        log_text = read_job_log(layout.job_log)
    failures = parse_torchrun_failures(log_text)
    log_errors = rank_errors_from_log(log_text)
    tracebacks = log_tracebacks(log_text)
    ranks: dict[int, RankEvidence] = {}
    lists = lists if lists is not None else RankLists()
    loaded = {r: load_rank(layout, r, lists)
              for r in sorted(set(rank_numbers(layout, table)) | set(tracebacks))}
    # torchrun restarted the worker group: what an earlier attempt raised is not the ranks'
    # of now (each record says its attempt), and neither is the log's copy of it
    attempt = max((e.heartbeat.restart or 0 for e in loaded.values() if e.heartbeat), default=0)
    earlier: dict[int, RankError] = {}
    for r, ev in loaded.items():
        if ev.error is not None and ev.error.restart is not None and ev.error.restart < attempt:
            earlier[r], ev.error = ev.error, None
        # a thread's exception of an earlier attempt, or one after the capture, neither
        ev.thread_errors = [e for e in ev.thread_errors
                            if (e.restart is None or e.restart >= attempt) and not (
                                table.captured_at is not None and e.time is not None
                                and e.time > table.captured_at)]
    # what was taken off (an earlier attempt's, or raised after the capture) goes from the
    # log's copies too
    dropped = {**earlier, **_after_capture(loaded, table.captured_at)}
    for r in loaded:
        if r in dropped and _same_error(dropped[r], tracebacks.get(r)):
            tracebacks.pop(r)
        if r in dropped and r in log_errors and log_errors[r].startswith(dropped[r].type):
            log_errors.pop(r)
        ev = loaded[r]
        info = table.ranks.get(r)
        if info is not None:
            ev.pid = info.pid if info.pid is not None else ev.pid
            ev.host = info.host if info.host is not None else ev.host
            ev.alive = info.alive
            if info.exit_code is not None:
                ev.exit_code = info.exit_code
            ev.progressed = info.progressed
            ev.activity = info.activity
            if info.note and info.alive:  # what the capture saw of it (its busy helpers)
                ev.notes.append(info.note)
        # (the capture saw it alive: the report of its end came after, when the job ended)
        alive_then = table.captured_at is not None and info is not None and info.alive
        if r in failures and ev.exit_code is None and not alive_then and (
                not attempt or ev.pid in (None, failures[r][1])):
            # (after a restart, a report of an earlier attempt's process is not this one's;
            # in one attempt the report's pid may be a wrapper's: a shell script's)
            ev.exit_code = failures[r][0]
        if ev.error is None and r in tracebacks:
            ev.error = tracebacks[r]  # the probe's record is first hand; the log is a copy
        elif ev.error is not None:  # ... of its first line only: a wrapped original is there
            ev.error = with_original(ev.error, tracebacks.get(r))
        elif ev.error is None and r in log_errors and (ev.exit_code or 0) > 0:
            typ, _, message = log_errors[r].partition(":")
            ev.error = RankError(type=typ, message=message.strip(), source="job log")
        ranks[r] = ev
    w = world or table.world_size
    if w is None:
        ws = [e.heartbeat.world for e in ranks.values() if e.heartbeat and e.heartbeat.world]
        w = max(ws) if ws else None
    out = Evidence(ranks=ranks, world_size=w, job=job or table.job,
                   job_exit_code=table.job_exit_code, agent_exit_code=table.agent_exit_code,
                   root_cause_rank=torchrun_root_cause(log_text),
                   log_lines=notable_log_lines(log_text), artifacts=str(root),
                   size_abort=gloo_size_abort(log_text), sampled=table.sampled,
                   restarts=Restarts(attempt, earlier) if attempt else None)
    attach_run_ras(out, layout.root)  # NCCL RAS polls taken at capture, if any
    out.source = read_source(layout)
    return out


def _after_capture(loaded: dict[int, RankEvidence], at: float | None) -> dict[int, RankError]:
    """The exceptions the ranks recorded after the capture was made (taken off them, with a
    note): the job's end that followed raised them (the tool ending it, a peer gone), not
    the hang — the verdict was made without them, and ``analyze`` of the directory later
    must say what it said."""
    late: dict[int, RankError] = {}
    if at is None:
        return late
    for r, ev in loaded.items():
        if ev.error is not None and ev.error.time is not None and ev.error.time > at:
            late[r], ev.error = ev.error, None
            ev.notes.append(f"raised {late[r].type} after the capture (as the job ended): "
                            "not evidence of the hang")
    return late


def read_source(layout: RunLayout) -> SourceFacts | None:
    """``source.json``: the source facts stored with the capture (None: none were)."""
    try:
        return SourceFacts.from_dict(json.loads(layout.source.read_text()))
    except (OSError, ValueError, RecursionError):
        return None


def load_captures(roots: list[Path]) -> Evidence:
    """Merge captures of one job taken on several nodes (``moe-hang analyze``): ranks are
    global, so each node contributes its own; the richest record wins a duplicate."""
    if not roots:
        raise ValueError("no capture directories")
    lists = RankLists()  # every node's dumps name the same groups
    parts = [load_capture(r, lists=lists) for r in roots]
    ranks: dict[int, RankEvidence] = {}
    for part in parts:
        for r, ev in part.ranks.items():
            old = ranks.get(r)
            if old is None or _richness(ev) > _richness(old):
                ranks[r] = ev
    worlds = [p.world_size for p in parts if p.world_size]
    jobs = [p.job for p in parts]
    # the most telling state any node saw
    job = next((j for j in (JobState.DESYNC, JobState.STALLED, JobState.FAILED,
                            JobState.RUNNING, JobState.COMPLETED) if j in jobs), jobs[0])
    lines: list[str] = []
    for p in parts:
        lines.extend(x for x in p.log_lines if x not in lines)
    agent = next((p.agent_exit_code for p in parts if p.agent_exit_code is not None), None)
    root_cause = next((p.root_cause_rank for p in parts if p.root_cause_rank is not None), None)
    aborts = [p.size_abort for p in parts if p.size_abort is not None]
    size_abort = next((a for a in aborts if a.received is not None), aborts[0] if aborts else None)
    # torchrun restarts each node's agent alike: the most restarts any saw, with every
    # node's ranks' records of that attempt
    most = max((p.restarts.count for p in parts if p.restarts is not None), default=None)
    restarts = Restarts(most, {r: e for p in parts if p.restarts is not None
                               and p.restarts.count == most
                               for r, e in p.restarts.errors.items()}) \
        if most is not None else None
    out = Evidence(ranks=ranks, world_size=max(worlds) if worlds else None, job=job,
                   agent_exit_code=agent, root_cause_rank=root_cause, log_lines=lines,
                   artifacts=", ".join(str(r) for r in roots), size_abort=size_abort,
                   sampled=any(p.sampled for p in parts), restarts=restarts)
    # NCCL RAS speaks for the whole job from any node: the first capture's polls, mapped
    # with every node's ranks
    polled = next((root for root, p in zip(roots, parts, strict=True) if p.ras), None)
    if polled is not None:
        attach_run_ras(out, Path(polled))
    for p in parts:  # each node read its own ranks' source
        if p.source is not None:
            if out.source is None:
                out.source = SourceFacts()
            out.source.merge(p.source)
    return out


def merge_into(ev: Evidence, part: Evidence, only: set[int] | None = None) -> list[int]:
    """Another node's capture beside this one's (a multi-node watch's round): its ranks this
    one lacks (of ``only``, where given), its job log's word on a size abort and the first
    failure, what its source said. Returns the ranks added."""
    added = sorted(r for r in set(part.ranks) - set(ev.ranks) if only is None or r in only)
    for r in added:
        ev.ranks[r] = part.ranks[r]
    if part.size_abort is not None and (ev.size_abort is None
                                        or ev.size_abort.received is None):
        ev.size_abort = part.size_abort
    if ev.root_cause_rank is None:
        ev.root_cause_rank = part.root_cause_rank
    ev.log_lines.extend(x for x in part.log_lines if x not in ev.log_lines)
    if part.source is not None:
        if ev.source is None:
            ev.source = SourceFacts()
        ev.source.merge(part.source)
    return added


def _richness(ev: RankEvidence) -> int:
    return (4 * (ev.fr is not None) + 2 * bool(ev.threads) + bool(ev.records)
            + bool(ev.heartbeat))
