"""What every command shares: the interrupt scope, capturing ranks while they are frozen,
turning a capture into a saved diagnosis, and the crash onset (docs/DESIGN.md §6)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.runs import RunInfo
from moe_hang.capture import dumps, pyspy, source
from moe_hang.capture.ras_job import capture_ras
from moe_hang.errors import Interrupted
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Evidence, ProcessRecord, ProcessTable, Unreached
from moe_hang.evidence.torchrun_log import parse_torchrun_failures, read_job_log
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import rundir
from moe_hang.runtime.procs import defer_interrupt, is_alive
from moe_hang.runtime.progress import ProgressSample
from moe_hang.runtime.watchevent import FROZEN, EventKind, Phase, WatchEvent
from moe_hang.settings import Settings

__all__ = ["Interrupted", "Phase", "capture_frozen", "crash_onset", "diagnose_capture",
           "interruptible", "record_source", "save"]


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM (and SIGINT) into :class:`Interrupted` while a command runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired: list[int] = []

    def raise_interrupt(signum: int, _frame: Any) -> None:
        if fired:
            # already unwinding: an impatient second Ctrl-C must not abort the teardown half
            # way (and leave ranks behind); the teardown is bounded anyway
            return
        if defer_interrupt(lambda: raise_interrupt(signum, None)):
            return  # a child is being started: raised as soon as it is on record
        fired.append(signum)
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in old:
        signal.signal(s, raise_interrupt)
    try:
        yield
    finally:
        for s, h in old.items():
            # once interrupted, the command is on its way out with 130/143: a further Ctrl-C
            # must not turn that into a KeyboardInterrupt ("Aborted!", exit 1) on the way
            signal.signal(s, signal.SIG_IGN if fired else h)


def capture_frozen(out: WatchEvent, layout: RunLayout, say: Phase, *, settings: Settings,
                   native: bool = False, ask_probes: bool = True) -> None:
    """Stacks from py-spy and Flight Recorder dumps from the probes, at the same time: of every
    rank of a stalled or desynced job, or of the survivors of one that failed (``ask_probes``
    False: there are none, the ranks are watched by sampling)."""
    live = {r: pid for r, pid in out.rank_pids.items() if is_alive(pid)}
    stalled = out.kind in FROZEN
    what = "stalled → capturing stacks" if stalled else "capturing the surviving ranks"
    say(f"{what} ({len(live)} ranks)")
    # a stalled job cannot move by construction; orphans of a dead agent may still be stepping
    sample = None if stalled else ProgressSample(layout.ranks_dir, live)
    stacks, errors = dumps.dumps_beside(
        {layout.ranks_dir: sorted(live)} if ask_probes else {},
        lambda: pyspy.pyspy_many(live, timeout=settings.pyspy_timeout_s, native=native,
                                 with_locals=True),
        timeout=settings.dump_timeout_s, grace=settings.pyspy_timeout_s)
    if sample is not None:
        out.progressed = sample.finish()
    pyspy.save_stacks(stacks, layout)
    # NCCL jobs only
    capture_ras(layout, out.heartbeats.values(), [dict(os.environ)], say, settings=settings)
    for r, err in errors.items():
        if err:
            layout.rank(r).dump_error.write_text(err)


def crash_onset(layout: RunLayout) -> float | None:
    """When the first rank crashed: its fatal-signal dump or its exception record."""
    times = []
    for p in layout.files_of(RankFiles.FATAL):
        with contextlib.suppress(OSError):
            if p.stat().st_size > 0:
                times.append(p.stat().st_mtime)
    for p in layout.files_of(RankFiles.ERROR):
        with contextlib.suppress(OSError, ValueError, KeyError):
            times.append(float(json.loads(p.read_text())["time"]))
    return min(times) if times else None


def diagnose_capture(layout: RunLayout, outcome: WatchEvent, alive: dict[int, bool], *,
                     world: int | None, ranks: Iterable[int], run: RunInfo | None = None,
                     held: str | None = None, unreached: Unreached | None = None) -> Diagnosis:
    """processes.json from what the watcher saw, then the diagnosis, written at once: when the
    job hung, the ranks are still frozen where they hung, and "onset -> verdict" is the time
    to a diagnosis on disk. ``held``: why a stall lived with is now final (--hang-after);
    ``unreached``: ranks of other nodes, never blamed here."""
    log_text = read_job_log(layout.job_log)
    failures = parse_torchrun_failures(log_text)
    table = ProcessTable(world_size=world, job=outcome.kind.job, job_exit_code=outcome.returncode,
                         agent_exit_code=outcome.returncode
                         if outcome.returncode is not None and outcome.returncode < 0 else None,
                         sampled=outcome.sampled)
    for r in ranks:
        hb = outcome.heartbeats.get(r)
        code = 0 if outcome.kind == EventKind.COMPLETED else failures.get(r, (None, None))[0]
        rec = ProcessRecord(pid=outcome.rank_pids.get(r), host=hb.host if hb else None,
                            alive=alive.get(r, False), exit_code=code)
        if outcome.kind in FROZEN and alive.get(r):
            # by construction no rank moved for --stall seconds (or they cannot move)
            rec.progressed = False
        elif r in outcome.progressed:
            rec.progressed = outcome.progressed[r]
        # watched by sampling: the counters of the last window (analysis/activity.py)
        rec.activity = outcome.activity.get(r) if alive.get(r) else None
        table.ranks[r] = rec
    table.captured_at = time.time()
    rundir.write_json(layout.processes, table.to_dict())
    ev = load_capture(layout.root, world=world, job=outcome.kind.job, log_text=log_text)
    ev.held, ev.unreached = held, unreached
    record_source(layout, ev)
    diag = diagnose(ev)
    diag.run = run
    rundir.write_json(layout.diagnosis, diag.to_dict())
    return diag


def record_source(layout: RunLayout, ev: Evidence) -> None:
    """The capture is being made here, beside the job's files: what the source says of its
    lines is read now and stored with it (``source.json``), so that the analysis — now, or
    ``moe-hang analyze`` of this directory anywhere later — never opens a source file."""
    rundir.write_json(layout.source, source.record(ev).to_dict())


def save(layout: RunLayout, diag: Diagnosis) -> None:
    """The final diagnosis; the probes' FIFOs go, they are only useful while the ranks live."""
    rundir.write_json(layout.diagnosis, diag.to_dict())
    for p in layout.files_of(RankFiles.CTL):
        with contextlib.suppress(OSError):
            p.unlink()
