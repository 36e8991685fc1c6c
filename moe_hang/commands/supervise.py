"""What ``watch`` does about what its monitor sees — one policy, for a job on one node and for
one that spans nodes (docs/DESIGN.md §9, §10).

Certainty decides: a definite (or likely) verdict ends the job (``--keep-running`` keeps it);
an uncertain one (a rank outside any collective, which may just be slow) is written down, said
in one line, and watched on until a rank moves ("resumed") or ``--hang-after`` passes, when
the same capture is made again as final. A capture on request (SIGUSR1) ends nothing.

What differs across nodes is behind :class:`Peers`: :class:`AloneOnNode` for a job on one
node; ``commands.multinode.NodePeers`` for one that spans nodes, where every decision is taken
on the one global verdict so that every node acts alike, and a stall while ranks of another
node still move is a straggler there, not a hang.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from moe_hang.analysis.diagnosis import Certainty, Diagnosis, Verdict, pg_label
from moe_hang.analysis.runs import Timings, WatchRun
from moe_hang.commands.session import Phase, capture_frozen, crash_onset, diagnose_capture
from moe_hang.evidence.model import Unreached
from moe_hang.evidence.stacks import Frame, short_path
from moe_hang.evidence.vocab import who
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import rundir
from moe_hang.runtime.monitor import Monitor
from moe_hang.runtime.procs import is_alive
from moe_hang.runtime.watchevent import FROZEN, ON_DEMAND, EventKind, WatchEvent
from moe_hang.settings import Settings


@dataclass
class WatchOptions:
    stall_s: float = 10.0
    hang_after_s: float = 300.0  # an uncertain stall becomes a hang after this long; 0: never
    keep_running: bool = False  # after a definite verdict, leave the job running
    native: bool = False
    shared_dir: str | None = None  # multi-node: coordinate through this directory
    env: tuple[tuple[str, str], ...] = ()  # set in the job's environment (check's plan)
    # moe-hang check: at this many seconds the job is captured, diagnosed and ended, whatever
    # it does (a plan's run is bounded); None: watch as long as the job runs
    limit_s: float | None = None
    # how often the monitor looks, and walks the process tree: slower beside a long job (its
    # own CPU would show up in the job's on a small machine) than for repro's seconds-long run
    poll_s: float = 0.25
    refresh_s: float = 2.0
    # no rank up after this long: the job did not start (repro's own job); watch waits on
    startup_timeout_s: float = float("inf")
    world: int | None = None  # the ranks the job starts, where the caller knows (repro)
    timings: Settings = field(default_factory=Settings)  # the tool's own waits (the CLI's)


# capture this node's ranks now and diagnose them; the kind says what the capture is for
Capture = Callable[[WatchEvent, EventKind], Diagnosis]


class Peers(Protocol):
    """The other watchers of the job, as far as the policy needs them."""

    def tick(self, mon: Monitor) -> bool:
        """Every poll: True when another watcher asked for a capture."""

    def requested(self) -> bool:
        """A capture request from another watcher is waiting."""

    def moving_elsewhere(self) -> dict[str, list[int]]:
        """Host -> its ranks that still move (a straggler there, not a hang here)."""

    def recheck_s(self) -> float:
        """How long until a straggler elsewhere is looked at again."""

    def alone(self) -> bool:
        """No other watcher to tell: a job that ended by itself is diagnosed afterwards."""

    def round(self, mon: Monitor, event: WatchEvent, kind: EventKind,
              capture: Callable[[], Diagnosis]) -> tuple[Diagnosis, EventKind]:
        """The verdict to act on (every node's one), and what its capture was for."""

    def next_round(self) -> None: ...

    def completed(self, event: WatchEvent) -> None:
        """The job finished here: say so to the others."""


class AloneOnNode:
    """A job on one node: nobody else to wait for, ask or tell."""

    def tick(self, mon: Monitor) -> bool:
        return False

    def requested(self) -> bool:
        return False

    def moving_elsewhere(self) -> dict[str, list[int]]:
        return {}

    def recheck_s(self) -> float:
        return 0.0

    def alone(self) -> bool:
        return True

    def round(self, mon: Monitor, event: WatchEvent, kind: EventKind,
              capture: Callable[[], Diagnosis]) -> tuple[Diagnosis, EventKind]:
        return capture(), kind

    def next_round(self) -> None:
        pass

    def completed(self, event: WatchEvent) -> None:
        pass


def supervise(mon: Monitor, peers: Peers, capture: Capture, layout: RunLayout,
              notice: Callable[[str], None], opts: WatchOptions,
              asked: threading.Event) -> tuple[WatchEvent, Diagnosis | None]:
    """Watch until the job ends or a verdict ends it; returns the last event and the
    diagnosis made while the ranks were still frozen (None: diagnose after the end)."""
    kept: Diagnosis | None = None  # --keep-running: the verdict the job outlives
    recheck_at: float | None = None  # a straggler elsewhere: when to look at it again
    limit_at = None if opts.limit_s is None else time.monotonic() + opts.limit_s

    def over() -> bool:
        return limit_at is not None and time.monotonic() >= limit_at

    def watched_on(line: str, diag: Diagnosis) -> None:
        # said in one line; the diagnosis behind it kept, for the line is all a person sees
        notice(line)
        kept_at = rundir.keep_watched(layout)
        with contextlib.suppress(OSError):  # a full disk must not end a job watched on
            rundir.append_jsonl(layout.watched, {
                "at": round(time.time(), 3), "said": line,
                "capture": None if kept_at is None else str(kept_at.relative_to(layout.root)),
                "diagnosis": diag.to_dict()})

    def stop() -> bool:
        if asked.is_set() or peers.tick(mon) or over():
            return True
        return recheck_at is not None and time.monotonic() >= recheck_at

    while True:
        event = mon.run(stop=stop)
        kind = event.kind
        if kind == EventKind.RESUMED:
            recheck_at = None
            notice(f"resumed after {event.stalled_for:.1f} s")
            continue
        if kind == EventKind.COMPLETED and not peers.alone():
            peers.completed(event)
            return event, kept
        held = mon.held_since is not None
        if kind == EventKind.REQUESTED and not asked.is_set() and not peers.requested() \
                and recheck_at is not None:
            # the straggler elsewhere watched on: still moving there? (a node whose watcher
            # died stops publishing, and its last summary goes stale: not moving)
            kind = event.kind = EventKind.STALLED
            event.reason = f"no progress on any rank for {mon.held_for():.1f} s"
        elif kind == EventKind.REQUESTED:
            asked.clear()
        elif kind == EventKind.STALLED and held:
            kind = EventKind.FINAL  # --hang-after passed on a stall lived with
        recheck_at = None
        if kind == EventKind.STALLED and not peers.requested():
            elsewhere = peers.moving_elsewhere()
            if elsewhere:
                where = "; ".join(f"{who(rs)} on node {h}" for h, rs in elsewhere.items())
                if not held:
                    notice(f"{who(event.ranks())} wait while {where} still move: "
                           "a straggler there, not a hang (still watching)")
                mon.hold()
                recheck_at = time.monotonic() + peers.recheck_s()
                continue
        alive = {r: is_alive(pid) for r, pid in event.rank_pids.items()}
        if kind not in (*FROZEN, *ON_DEMAND) and not any(alive.values()) and peers.alone():
            return event, kept  # the job ended by itself: diagnose what it left
        if kept is not None and kind not in ON_DEMAND:
            return event, kept  # what follows a kept verdict (a timeout, a teardown) is its echo
        diag, rk = peers.round(mon, event, kind, functools.partial(capture, event, kind))
        if rk in ON_DEMAND and over():
            notice(f"{opts.limit_s:.0f} s passed: {diag.verdict}, and the job is ended")
            return event, diag
        if rk in ON_DEMAND:
            watched_on(f"on request: {diag.verdict}: {diag.summary[:160]} "
                       f"({layout.diagnosis})", diag)
            rundir.write_json(layout.diagnosis, diag.to_dict())
            peers.next_round()
            continue
        if rk == EventKind.STALLED and peers.alone() and mon.job.poll() == 0:
            # the launcher exited 0 while we captured: every rank finished, so whatever the
            # capture caught (a stack older than the rank's last steps) was no hang
            caught = ("" if diag.verdict == Verdict.HEALTHY
                      else f": what looked like {_A_VERDICT[diag.verdict]} was its end")
            watched_on(f"the job finished during the capture{caught} (watched on)", diag)
            continue
        if rk == EventKind.STALLED and diag.verdict == Verdict.HEALTHY:
            # the capture saw the ranks move (a rank past the collective its older stack
            # showed): no stall to end the job for; watched on, as an uncertain one is
            watched_on(f"{diag.summary} (watched on)", diag)
            mon.hold()
            peers.next_round()
            continue
        if rk == EventKind.STALLED and diag.certainty == Certainty.UNCERTAIN:
            watched_on(f"{diag.summary} (not ended: still watching)"
                       if diag.rule_id == "unreached" else waiting_line(diag, opts.stall_s),
                       diag)
            mon.hold()
            peers.next_round()
            continue
        if rk == EventKind.FINAL and diag.verdict == Verdict.INCONCLUSIVE:
            # --hang-after passed, but nothing here could see whether the ranks move (watched
            # by sampling, on NCCL): time alone does not make that a hang
            watched_on(f"{diag.summary} (not ended: nothing here can tell; still watching)",
                       diag)
            mon.s.hang_after_s = 0.0
            mon.hold()
            peers.next_round()
            continue
        if opts.keep_running and rk in FROZEN:
            watched_on(f"{diag.verdict}: {diag.summary[:160]} — the job keeps running "
                       "(--keep-running)", diag)
            kept = diag
            mon.s.hang_after_s = 0.0
            mon.hold()
            peers.next_round()
            continue
        return event, diag


def capture_and_diagnose(event: WatchEvent, kind: EventKind, layout: RunLayout,
                         cmd: list[str], say: Phase, opts: WatchOptions) -> Diagnosis:
    """Capture this node's ranks while they are frozen, and diagnose them. A rank of this node
    is never blamed for waiting on another node's: those are unreached here."""
    alive = {r: is_alive(pid) for r, pid in event.rank_pids.items()}
    capture_frozen(event, layout, say, settings=opts.timings, native=opts.native,
                   ask_probes=not event.sampled)
    rundir.snapshot_capture(layout)  # what the verdict comes from, kept if it ends the job
    say("analysing")
    return diagnose_watched(layout, event, alive, cmd, kind)


def diagnose_watched(layout: RunLayout, event: WatchEvent, alive: dict[int, bool],
                     cmd: list[str], kind: EventKind | None = None) -> Diagnosis:
    """The diagnosis of what watch captured (``kind`` FINAL: a held stall, now a hang)."""
    timings = Timings()
    world = event.world_size()
    diag = diagnose_capture(layout, event, alive, world=world, ranks=event.ranks(),
                            run=WatchRun(command=cmd, job_exit_code=event.returncode,
                                         detected=event.kind, timings=timings),
                            held=event.reason if kind == EventKind.FINAL else None,
                            unreached=other_nodes(event))
    # the stall's or desync's onset, else the first rank's crash (its exception or fatal
    # signal, on disk); on disk with the final save
    onset = event.onset_ns / 1e9 if event.onset_ns else crash_onset(layout)
    if onset is not None and diag.verdict != Verdict.HEALTHY:
        timings.onset_to_verdict_s = round(time.time() - onset, 3)
        if event.t_detect:
            timings.onset_to_detect_s = round(event.t_detect - onset, 3)
    return diag


def other_nodes(event: WatchEvent) -> Unreached | None:
    """The ranks of a job that spans nodes that this node does not run (its ranks say
    WORLD_SIZE is more than they are); None on one node."""
    world, ranks = event.world_size(), event.ranks()
    if not world or world <= len(ranks):
        return None
    lw = next((hb.local_world for hb in event.heartbeats.values() if hb.local_world),
              event.local_world)
    return Unreached(sorted(set(range(world)) - set(ranks)), local_world=lw or len(ranks))


_A_VERDICT = {Verdict.DESYNC: "a desync", Verdict.HANG: "a hang", Verdict.CRASH: "a crash",
              Verdict.RANK_DIED: "a dead rank", Verdict.STRAGGLER: "a straggler",
              Verdict.INCONCLUSIVE: "something", Verdict.TRANSPORT_HANG: "a transport hang",
              Verdict.HEALTHY: "nothing"}


def _here(f: Frame) -> str:
    """``file:line function``, the file relative to the working directory when under it."""
    rel = os.path.relpath(f.file) if os.path.isabs(f.file) else f.file
    return f"{rel if not rel.startswith('..') else short_path(f.file)}:{f.line} {f.function}"


def waiting_line(diag: Diagnosis, stall_s: float) -> str:
    """"waiting 10 s on rank 1 at sleepy.py:8 next_batch; rank 0 in all_reduce default_pg#3"."""
    parts = []
    for r in diag.culprit_ranks:
        rep = diag.rank(r)
        parts.append(f"rank {r}" + (f" at {_here(rep.callsite)}" if rep and rep.callsite
                                    else ""))
    for rep in diag.ranks:
        if rep.rank not in diag.culprit_ranks and rep.collective is not None:
            c = rep.collective
            seq = f" {pg_label(c.pg, c.pg_desc, word='pg')}#{c.seq}" if c.seq is not None else ""
            parts.append(f"rank {rep.rank} in {c.op}{seq}")
    if not parts:  # no culprit, no collective (inside the group's creation): where they are
        at: dict[str, list[int]] = {}
        for rep in diag.ranks:
            if rep.callsite is not None:
                at.setdefault(_here(rep.callsite), []).append(rep.rank)
        parts = [f"{who(rs)} at {where}" for where, rs in at.items()]
    head = f"waiting {stall_s:.0f} s on " + (parts[0] if parts else "the job")
    return "; ".join([head, *parts[1:]]) + " (not ended: it may only be slow; still watching)"
