"""Read a capture directory back into :class:`~moe_hang.evidence.Evidence`.

Layout (the same for repro, diagnose and watch, so ``analyze`` can merge any of them)::

    ranks/rank{R}.hb.json        heartbeat           ranks/rank{R}.fr.pkl      Flight Recorder
    ranks/rank{R}.tokens.jsonl   EP token log        ranks/rank{R}.stack.txt   faulthandler dump
    ranks/rank{R}.fatal.txt      fatal-signal stack  ranks/rank{R}.error.json  exception
    ranks/rank{R}.groups.json    process groups      ranks/rank{R}.dump.json   dump marker
    stacks/rank{R}.pyspy.json    py-spy --json       stacks/rank{R}.pyspy.err  why not
    processes.json               pid / alive / exit code per rank, as seen at capture time
    job.log                      the job's own output

Anything unreadable (a rank died while writing it) is reported on that rank and skipped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from moe_hang import frtrace
from moe_hang.evidence import (
    Evidence,
    RankEvidence,
    gloo_size_abort,
    notable_log_lines,
    parse_torchrun_failures,
    rank_errors_from_log,
    torchrun_root_cause,
)
from moe_hang.stacks import Frame, ThreadStack, parse_faulthandler, parse_probe_frames, parse_pyspy

_TB_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')


def _read_json(path: Path, ev: RankEvidence, what: str) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        ev.notes.append(f"{what} unreadable ({type(exc).__name__})")
        return None


def traceback_frames(lines: list[str]) -> list[Frame]:
    frames = []
    for line in lines:
        m = _TB_FRAME.match(line)
        if m:
            frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return list(reversed(frames))


def load_rank(root: Path, rank: int) -> RankEvidence:
    rd, sd = root / "ranks", root / "stacks"
    ev = RankEvidence(rank=rank)
    hb = _read_json(rd / f"rank{rank}.hb.json", ev, "heartbeat")
    if isinstance(hb, dict):
        ev.heartbeat = hb
        ev.pid = hb.get("pid")
        ev.host = hb.get("host")
    fr_path = rd / f"rank{rank}.fr.pkl"
    if fr_path.exists():
        try:
            ev.fr = frtrace.load(fr_path)
        except Exception as exc:
            ev.fr_error = f"{type(exc).__name__}: {exc}"[:160]
    tok = rd / f"rank{rank}.tokens.jsonl"
    if tok.exists():
        bad = 0
        for line in tok.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                if isinstance(rec, dict):
                    ev.records.append(rec)
            except ValueError:
                bad += 1  # the last line of a rank that died mid-write
        if bad:
            ev.notes.append(f"{bad} unreadable line(s) in its token log")
    err = _read_json(rd / f"rank{rank}.error.json", ev, "error record")
    if isinstance(err, dict):
        ev.error = err
    groups = _read_json(rd / f"rank{rank}.groups.json", ev, "process-group list")
    if isinstance(groups, dict):
        ev.groups = {str(k): [int(x) for x in v] for k, v in groups.items()
                     if isinstance(v, list)}
    fatal = rd / f"rank{rank}.fatal.txt"
    if fatal.exists():
        text = fatal.read_text(errors="replace")
        if text.strip():
            ev.fatal = text
    _load_stacks(ev, rd, sd, rank)
    return ev


def _load_stacks(ev: RankEvidence, rd: Path, sd: Path, rank: int) -> None:
    spy = sd / f"rank{rank}.pyspy.json"
    if spy.exists():
        try:
            ev.threads = parse_pyspy(json.loads(spy.read_text()))
            ev.stack_source = "py-spy"
            return
        except (OSError, ValueError) as exc:
            ev.notes.append(f"py-spy output unreadable ({type(exc).__name__})")
    spy_err = sd / f"rank{rank}.pyspy.err"
    if spy_err.exists():
        ev.stack_error = spy_err.read_text(errors="replace").strip()[:200] or None
    if ev.fatal:
        ev.threads = parse_faulthandler(ev.fatal)
        ev.stack_source = "faulthandler (fatal signal)"
        return
    marker = _read_json(rd / f"rank{rank}.dump.json", ev, "dump marker")
    stack = rd / f"rank{rank}.stack.txt"
    reason = marker.get("reason") if isinstance(marker, dict) else None
    if stack.exists() and reason != "exception":
        threads = parse_faulthandler(stack.read_text(errors="replace"))
        # the dumping thread is the probe's; the rank's own work is on the main thread
        ev.threads = [t for t in threads if not _is_probe_thread(t)] or threads
        ev.stack_source = f"faulthandler ({reason or 'dump'})"
        return
    if ev.error and (ev.error.get("frames") or ev.error.get("traceback")):
        frames = parse_probe_frames(ev.error.get("frames")) or traceback_frames(
            list(ev.error.get("traceback") or []))
        if frames:
            ev.threads = [ThreadStack("MainThread", frames, is_main=True)]
            ev.stack_source = "exception traceback"


def _is_probe_thread(t: ThreadStack) -> bool:
    return any("moe_hang/probe.py" in f.file for f in t.frames)


def rank_numbers(root: Path, procs: dict[int, dict[str, Any]] | None = None) -> list[int]:
    """Every rank with a file in the capture or an entry in processes.json (``procs``: that
    file's ranks, already read; read here when None)."""
    found: set[int] = set()
    for d in (root / "ranks", root / "stacks"):
        if d.is_dir():
            for p in d.iterdir():
                m = re.match(r"rank(\d+)\.", p.name)
                if m:
                    found.add(int(m.group(1)))
    found.update(_processes(_read_processes(root)) if procs is None else procs)
    return sorted(found)


def _read_processes(root: Path) -> dict[str, Any]:
    """processes.json, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads((root / "processes.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _processes(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """processes.json's per-rank entries by rank ({} when malformed)."""
    try:
        return {int(k): v for k, v in data.get("ranks", {}).items()}
    except (ValueError, AttributeError):
        return {}


LOG_TAIL_BYTES = 16 << 20


def read_job_log(root: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The end of the job's output: torchrun's failure summary, the aborts and tracebacks that
    end a job are at its end, and a long training job's log may be gigabytes."""
    try:
        with open(root / "job.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def load(root: Path, *, world: int | None = None, job: str | None = None,
         log_text: str | None = None) -> Evidence:
    """Evidence from one capture directory (one node, or a whole single-node job).
    ``log_text``: the job log when the caller has already read it."""
    procs_all = _read_processes(root)
    procs = _processes(procs_all)
    if log_text is None:
        log_text = read_job_log(root)
    failures = parse_torchrun_failures(log_text)
    log_errors = rank_errors_from_log(log_text)
    ranks = {}
    for r in rank_numbers(root, procs):
        ev = load_rank(root, r)
        info = procs.get(r, {})
        ev.pid = info.get("pid", ev.pid)
        ev.host = info.get("host", ev.host)
        if "alive" in info:
            ev.alive = bool(info["alive"])
        if info.get("exit_code") is not None:
            ev.exit_code = int(info["exit_code"])
        if r in failures and (ev.exit_code is None):
            ev.exit_code = failures[r][0]
        if "progressed" in info:
            ev.progressed = info["progressed"]
        if ev.error is None and r in log_errors and (ev.exit_code or 0) > 0:
            typ, _, message = log_errors[r].partition(":")
            ev.error = {"type": typ, "message": message.strip(), "source": "job log"}
        ranks[r] = ev
    w = world or procs_all.get("world_size")
    if w is None:
        ws = [int(e.heartbeat["world"]) for e in ranks.values()
              if e.heartbeat and e.heartbeat.get("world")]
        w = max(ws) if ws else None
    return Evidence(ranks=ranks, world_size=w, job=job or procs_all.get("job", "stalled"),
                    job_exit_code=procs_all.get("job_exit_code"),
                    agent_exit_code=procs_all.get("agent_exit_code"),
                    root_cause_rank=torchrun_root_cause(log_text),
                    log_lines=notable_log_lines(log_text), artifacts=str(root),
                    size_abort=gloo_size_abort(log_text))


def load_many(roots: list[Path]) -> Evidence:
    """Merge captures of one job taken on several nodes (``moe-hang analyze``): ranks are
    global, so each node contributes its own; the richest record wins a duplicate."""
    if not roots:
        raise ValueError("no capture directories")
    parts = [load(r) for r in roots]
    ranks: dict[int, RankEvidence] = {}
    for part in parts:
        for r, ev in part.ranks.items():
            old = ranks.get(r)
            if old is None or _richness(ev) > _richness(old):
                ranks[r] = ev
    worlds = [p.world_size for p in parts if p.world_size]
    jobs = [p.job for p in parts]
    job = next((j for j in ("desync", "stalled", "failed", "running", "completed")
                if j in jobs), jobs[0])
    lines: list[str] = []
    for p in parts:
        lines.extend(x for x in p.log_lines if x not in lines)
    agent = next((p.agent_exit_code for p in parts if p.agent_exit_code is not None), None)
    root_cause = next((p.root_cause_rank for p in parts if p.root_cause_rank is not None), None)
    aborts = [p.size_abort for p in parts if p.size_abort is not None]
    size_abort = next((a for a in aborts if a.received is not None), aborts[0] if aborts else None)
    return Evidence(ranks=ranks, world_size=max(worlds) if worlds else None, job=job,
                    agent_exit_code=agent, root_cause_rank=root_cause, log_lines=lines,
                    artifacts=", ".join(str(r) for r in roots), size_abort=size_abort)


def _richness(ev: RankEvidence) -> int:
    return (4 * (ev.fr is not None) + 2 * bool(ev.threads) + bool(ev.records)
            + bool(ev.heartbeat))
