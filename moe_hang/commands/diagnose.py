"""``moe-hang diagnose PID``: capture a running job we did not start, and diagnose it; and
``moe-hang analyze DIR...``: diagnose captures after the fact, one per node merged.

A few py-spy samples of every rank, a short interval apart, tell a stuck rank (same frames, off
CPU) from a progressing one. Where the job runs under ``moe-hang watch`` its probes also hand
over Flight Recorder dumps; ``--fr-dir`` adds the user's own dumps (pickle or JSON, NCCL or
gloo). Nothing is sent to the job except the probe's dump request; it keeps running.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.runs import AttachRun, Timings
from moe_hang.capture import dumps, pyspy, source, window
from moe_hang.capture.ras_job import capture_ras
from moe_hang.capture.window import progressed  # noqa: F401 - tests import it here
from moe_hang.commands import identify
from moe_hang.commands.session import Phase, record_source
from moe_hang.errors import MoeHangError
from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence import identity, rankid
from moe_hang.evidence.flight_recorder import postmortem
from moe_hang.evidence.flight_recorder.load_sets import gc_paused
from moe_hang.evidence.load import load_capture, load_captures
from moe_hang.evidence.model import Evidence, ProcessRecord, ProcessTable, RankEvidence, Unreached
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.ras import RasPoll
from moe_hang.evidence.ras_files import attach_ras, other_job
from moe_hang.evidence.vocab import JobState, who
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import rundir
from moe_hang.runtime.discover import FoundJob, find_job, find_jobs, launcher_of
from moe_hang.runtime.procs import is_alive
from moe_hang.settings import Settings

SAMPLES = window.SAMPLES


def _completed(job: FoundJob) -> dict[int, dict[str, int]]:
    """Per rank with a probe: the last completed sequence number per group, now."""
    out: dict[int, dict[str, int]] = {}
    for r in job.ranks:
        if not r.probe_dir:
            continue
        with contextlib.suppress(OSError, ValueError):
            hb = Heartbeat.parse(json.loads(RankFiles(Path(r.probe_dir), r.rank)
                                            .heartbeat.read_text()))
            if hb is not None and hb.pg_status is not None:
                out[r.rank] = {pg: s.completed for pg, s in hb.pg_status.items()}
    return out


def _copy_probe_files(job: FoundJob, out: RunLayout) -> None:
    for r in job.ranks:
        if not r.probe_dir:
            continue
        for p in RankFiles(Path(r.probe_dir), r.rank).probe_files():
            if p.exists():
                with contextlib.suppress(OSError):
                    shutil.copyfile(p, out.ranks_dir / p.name)


def _copy_fr_dir(fr_dir: Path, out: RunLayout) -> list[str]:
    if not fr_dir.is_dir():
        raise MoeHangError(f"--fr-dir {fr_dir}: not a directory")
    dumps, errors = fr.load_dir(fr_dir)
    notes = [f"{name}: {err}" for name, err in errors.items()]
    for r, dump in dumps.items():
        dest = out.rank(r).fr  # pickle or JSON: the loader reads either
        if dump.source is not None and not dest.exists():
            # a fresh dump from a live probe wins over an old file
            shutil.copyfile(dump.source, dest)
    if not dumps:
        notes.append(f"no Flight Recorder dump found in {fr_dir}")
    return notes


def capture_job(job: FoundJob, out: RunLayout, say: Phase, *, settings: Settings,
                native: bool = False, fr_dir: Path | None = None) -> float:
    t0 = time.monotonic()
    out.ranks_dir.mkdir(exist_ok=True, mode=0o700)
    pids = {r.rank: r.pid for r in job.ranks}
    probe_ranks: dict[str, list[int]] = {}
    for r in job.ranks:
        if r.probe_dir:
            probe_ranks.setdefault(r.probe_dir, []).append(r.rank)
    say(f"capturing stacks of {len(pids)} ranks ({SAMPLES} samples)")
    done0 = _completed(job)
    win, dump_errors = dumps.dumps_beside(
        {Path(d): ranks for d, ranks in probe_ranks.items()},
        lambda: window.sample_window(pids, settings, native=native),
        timeout=settings.dump_timeout_s, grace=settings.pyspy_timeout_s)
    done1 = _completed(job)
    pyspy.save_stacks({r: w.final for r, w in win.items()}, out)
    outside = {r for r, w in win.items()
               if w.final.data is not None and not window.in_collective(w.final.data)}
    pyspy.save_helpers(pyspy.helper_stacks(pids, outside, timeout=settings.pyspy_timeout_s),
                       out)
    # a collective that completed on one rank while we looked completed on every member: the
    # job is progressing, however each stack looked (a fast job is caught in collectives)
    advanced = any(done1.get(r, {}).get(pg, -1) > c for r, st in done0.items()
                   for pg, c in st.items())
    _copy_probe_files(job, out)
    notes: list[str] = []
    if fr_dir is not None:
        notes = _copy_fr_dir(fr_dir, out)
    table = ProcessTable(world_size=job.world_size, job=JobState.RUNNING,
                         agent_pid=job.agent or job.launcher,
                         target_pid=job.target, notes=notes,
                         orphans=[(o.rank, o.pid) for o in job.orphans],
                         probe_errors={k: v for k, v in dump_errors.items() if v})
    for r in job.ranks:
        w = win[r.rank]
        moved = None if w.moved is None else (advanced or w.moved)
        helpers = (f"its own child processes (DataLoader or compile workers) kept "
                   f"{w.helpers_cores:.1f} cores busy while we looked"
                   if w.helpers_cores > window.BUSY_CORES else None)
        table.ranks[r.rank] = ProcessRecord(pid=r.pid, host=r.host, alive=True,
                                            progressed=moved, local_rank=r.local_rank,
                                            env=r.env, activity=w.activity, note=helpers)
    for missing in job.missing_ranks():
        table.ranks[missing] = ProcessRecord(alive=False, note="no process found for this rank")
    rundir.write_json(out.processes, table.to_dict())
    return time.monotonic() - t0  # seconds the capture took


@contextlib.contextmanager
def _capture_dir(out: Path | None) -> Iterator[RunLayout]:
    if out is not None:
        yield RunLayout(rundir.create(out, "diagnose").resolve())
        return
    tmp = Path(tempfile.mkdtemp(prefix="moe-hang-diagnose-"))
    try:
        yield RunLayout(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pick_job() -> int:
    """``diagnose`` without a PID: the one distributed job on this host, else an error that
    lists them."""
    jobs = find_jobs()
    if not jobs:
        raise MoeHangError("no distributed PyTorch job on this host (no process of yours has "
                           "joined a process group or has RANK in its environment): give its "
                           "PID")
    if len(jobs) > 1:
        listing = "\n".join(f"  {j.describe()}" for j in jobs)
        raise MoeHangError(f"{len(jobs)} distributed jobs on this host; give the PID of one:\n"
                           f"{listing}")
    return jobs[0].pid


def _with_other_nodes(ev: Evidence, job: FoundJob, shared_dir: Path | None,
                      say: Phase, fresh_s: float) -> Diagnosis | None:
    """A multi-node job: the ranks of the other nodes from their watchers' latest summaries
    (where ``moe-hang watch`` runs there); ranks nobody speaks for are unknown, and this
    node's ranks are not blamed for waiting on them."""
    world = job.world_size
    local = {r.rank for r in job.ranks}
    if not world or world <= len(local):
        return None  # one node: nothing to add
    from moe_hang.commands import multinode

    lw = next((int(r.env["LOCAL_WORLD_SIZE"]) for r in job.ranks
               if r.env.get("LOCAL_WORLD_SIZE", "").isdigit()), None) or len(local)
    cmd, env = launcher_of(job)
    say("reading the other nodes' summaries")
    others, why = multinode.peers_for_diagnose(cmd, env, shared_dir, local, fresh_s=fresh_s)
    added = multinode.merge_remote(ev, others)
    if added:
        ev.log_lines.append(f"{who(added)} from their nodes' watchers: "
                            + ", ".join(f"node {n} ({s.host})" for n, s in sorted(others.items())))
    elif why:
        ev.log_lines.append(f"other nodes: {why}")
    ev.world_size = world
    unknown = multinode.unreached_ranks(world, ev.ranks)
    if unknown:
        ev.unreached = Unreached(unknown, local_world=lw,
                                 hosts={n: s.host for n, s in others.items()})
    return diagnose(ev)


def diagnose_pid(pid: int, say: Phase, *, settings: Settings, out: Path | None = None,
                 native: bool = False, fr_dir: Path | None = None,
                 command: list[str] | None = None, shared_dir: Path | None = None,
                 ras: list[RasPoll] | None = None) -> Diagnosis:
    t0 = time.monotonic()
    say(f"finding the ranks of PID {pid}")
    job = find_job(pid)
    has_probe = any(r.probe_dir for r in job.ranks)
    if not has_probe and fr_dir is None:
        pyspy.require_pyspy()  # nothing else could tell us where the ranks are
    identify.from_frames(job, say, timeout=settings.pyspy_timeout_s)
    unknown = {r.rank for r in job.unidentified()}
    if unknown:
        # a rank of unknown number may be any one of the world's: with the world size the
        # analysis would expect numbers nobody has, and call them missing
        job.world_size = None
    with _capture_dir(out) as d:
        rundir.write_json(d.meta, rundir.meta(command or ["moe-hang", "diagnose", str(pid)]))
        capture_s = capture_job(job, d, say, settings=settings, native=native, fr_dir=fr_dir)
        _refuse_an_ended_job(job, pid, settings.ending_wait_s)
        if not ras:  # NCCL RAS, two polls (NCCL jobs only); --ras FILE replaces them
            capture_ras(d, envs=[r.env for r in job.ranks], say=say, settings=settings)
        errs = [d.rank(r.rank).pyspy_error for r in job.ranks]
        if all(p.exists() for p in errs) and not has_probe and fr_dir is None:
            raise MoeHangError(errs[0].read_text().strip() or "py-spy could not read any rank")
        say("analysing")
        ev = load_capture(d.root, world=job.world_size, job=JobState.RUNNING)
        if ras:
            attach_ras(ev, ras)
        for r in job.missing_ranks():
            ev.ranks.setdefault(r, RankEvidence(rank=r, alive=False))
            ev.ranks[r].alive = False
            ev.ranks[r].notes.append("no process found for this rank on this machine")
            for o in job.orphans:
                if o.rank == r:
                    ev.ranks[r].notes.append(
                        f"its child process {o.pid} (a forked worker) still holds its "
                        "connections, so the other ranks got no error and wait forever")
        record_source(d, ev)
        diag = (_with_other_nodes(ev, job, shared_dir, say, settings.summary_fresh_s)
                or diagnose(ev))
        _name_unidentified(diag, unknown)
        diag.artifacts = str(d.root) if out is not None else ""
        diag.run = AttachRun(target_pid=pid, agent_pid=job.agent or job.launcher,
                             timings=Timings(capture_s=round(capture_s, 3),
                                             wall_s=round(time.monotonic() - t0, 3)))
        if out is not None:
            rundir.write_json(d.diagnosis, rankid.relabel_json(diag.to_dict()))
        return diag


def _refuse_an_ended_job(job: FoundJob, pid: int, wait_s: float) -> None:
    """A job that ended while we looked is not stuck, and what its ranks left (stacks of
    exiting processes, none at all) says nothing of a hang: no verdict, one line, exit 1. A
    rank gone while we looked: ``wait_s`` (``Settings.ending_wait_s``) for the whole job to
    end too."""
    deadline = time.monotonic() + wait_s
    while True:
        gone = [r.rank for r in job.ranks if not is_alive(r.pid, r.create_time or None)]
        ended = not is_alive(job.target) or (job.ranks and len(gone) == len(job.ranks))
        if ended or not gone or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if ended:
        raise MoeHangError(f"PID {pid}'s job ended while it was being diagnosed: nothing is "
                           "stuck (whether it succeeded is its launcher's exit status to say)")


def _name_unidentified(diag: Diagnosis, keys: set[int]) -> None:
    """Every sentence names a rank of unknown number by its PID (evidence.rankid)."""
    if not keys:
        return
    diag.summary = rankid.relabel_text(diag.summary, keys)
    diag.fix = rankid.relabel_text(diag.fix, keys)
    diag.evidence = [rankid.relabel_text(e, keys) for e in diag.evidence]
    for r in diag.ranks:
        if r.note:
            r.note = rankid.relabel_text(r.note, keys)


def analyze_paths(paths: list[Path], *, force: bool, ras: list[RasPoll] | None = None,
                  settings: Settings = Settings()) -> Diagnosis:
    """One verdict from moe-hang captures (run directories, one per node) and torch's own
    Flight Recorder dumps (directories, prefixes, files), alone or mixed, and NCCL RAS
    reports (``ras``: ``--ras FILE``, which replace a capture's own polls). Sources that are
    not one job are refused unless ``force``; a file that gives nothing is reported in the
    evidence; nothing readable at all is a one-line error."""
    if not paths and ras:  # RAS reports alone
        only = Evidence(ranks={}, artifacts=", ".join(p.source for p in ras))
        attach_ras(only, ras)
        return diagnose(only)
    captures = [p.expanduser() for p in paths
                if p.expanduser().is_dir() and RunLayout(p.expanduser()).is_capture()]
    others = [p for p in paths if p.expanduser() not in captures]
    found = postmortem.find(others)
    try:
        loaded = postmortem.load_sets(found.sets, settings=settings)
    except TimeoutError as exc:
        raise MoeHangError(str(exc)) from None
    readable = [ls for ls in loaded if ls.fr]
    if not captures and not readable:
        problems = [*found.problems, *(pb for ls in loaded for pb in ls.problems)]
        raise MoeHangError("nothing to analyze: " + _problems_line(problems))
    idents = [identity.of_capture(c) for c in captures] + [identity.of_dumps(ls)
                                                           for ls in readable]
    differ = identity.mismatch(idents)
    if differ is not None and not force:
        raise MoeHangError(differ, hint="pass --force to analyze them together")
    unread = [ls for ls in loaded if not ls.fr]
    extra = [*found.problems, *(pb for ls in unread for pb in ls.problems)]
    if differ is not None:
        extra.append(postmortem.Problem(Path(idents[0].label), f"analyzed together (--force) "
                                                            f"although {differ}"))
    dumped = postmortem.evidence(readable, extra=extra) if readable or extra else None
    # the node that analysed a multi-node watch's round kept every other node's capture
    given = {c.resolve() for c in captures}
    kept = [d for c in captures for d in RunLayout(c).node_captures()
            if d.resolve() not in given]
    try:
        ev = load_captures(captures + kept) if captures else None
    except (OSError, ValueError) as exc:
        raise MoeHangError(f"cannot read the captures: {exc}") from None
    if ev is None:
        assert dumped is not None
        ev = dumped
    elif dumped is not None:
        ev = postmortem.merge(ev, dumped)
    elif (unknown := _other_nodes(captures, ev)) is not None:
        ev.unreached = unknown
    ev.artifacts = ", ".join(str(p) for p in paths)
    if ras:
        if (why := other_job(ev, ras)) is not None and not force:
            raise MoeHangError(why, hint="pass --force to analyze them together")
        attach_ras(ev, ras)
    source.complete(ev)
    with gc_paused(freeze=False):
        return diagnose(ev)


def _other_nodes(captures: list[Path], ev: Evidence) -> Unreached | None:
    """The ranks of a multi-node watch's other nodes, where the captures given are not all of
    the job's: unknown, never blamed (as in the watch's own round for a node that did not
    answer), and the hosts its verdict names, to say where they are."""
    hosts: dict[str, str] = {}
    for c in captures:
        try:
            v = json.loads(RunLayout(c).coord_verdict.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(v, dict) and isinstance(v.get("hosts"), dict):
            hosts.update({str(k): str(h) for k, h in v["hosts"].items()})
    if not hosts:
        return None  # not a multi-node watch's
    from moe_hang.commands.multinode import unreached_ranks

    missing = unreached_ranks(ev.world_size, ev.ranks)
    if not missing:
        return None
    lw = next((e.heartbeat.local_world for e in ev.ranks.values()
               if e.heartbeat is not None and e.heartbeat.local_world), None)
    return Unreached(missing, local_world=lw, hosts=hosts, not_given=True)


def _problems_line(problems: list[postmortem.Problem], most: int = 4) -> str:
    """Why nothing could be read, on one line: the first few files and their reasons."""
    if not problems:
        return "no path given"
    shown = "; ".join(" ".join(pb.line().split()) for pb in problems[:most])
    return shown + (f"; and {len(problems) - most} more" if len(problems) > most else "")
