"""Watch a running job through its ranks' heartbeats until it ends, crashes, stalls or desyncs.

A rank counts as *moving* while its heartbeat fingerprint (progress, Flight Recorder
``pg_status``, main-thread frame) changes or its CPU time grows. The job has *stalled* when no
live rank has moved for ``stall_s`` seconds while at least one waits in a collective. A
*desync* is declared sooner: as soon as every rank's heartbeat shows a collective pending at
the same sequence number with a different op, size or dtype, nothing can ever complete.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe_hang.evidence.model import Heartbeat
from moe_hang.probe.layout import RankFiles
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.procs import CpuClock, is_alive, main_thread_cpu

Phase = Callable[[str], None]  # what a command shows as its live phase ("capturing stacks")
CPU_MOVING_S = 0.02
CPU_MOVING_RATE = 0.02  # of one core


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


@dataclass
class Outcome:
    kind: str  # completed | failed | stalled | desync | startup_timeout | interrupted
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


def read_heartbeats(probe_dir: Path) -> dict[int, Heartbeat]:
    out: dict[int, Heartbeat] = {}
    if not probe_dir.is_dir():
        return out
    for p in probe_dir.glob("rank*.hb.json"):
        try:
            hb = Heartbeat.parse(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # mid-rename or a rank that died writing: next poll
        if hb is not None:
            out[hb.rank] = hb
    return out


def onset_ns(heartbeats: dict[int, Heartbeat]) -> int | None:
    """Creation time of the oldest collective still pending anywhere (the hang's onset)."""
    times = [int(e["time_created_ns"]) for hb in heartbeats.values()
             for e in hb.pending if isinstance(e.get("time_created_ns"), (int, float))]
    return min(times) if times else None


def world_of(hbs: dict[int, Heartbeat]) -> int | None:
    """WORLD_SIZE as the ranks report it."""
    return next((hb.world for hb in hbs.values() if hb.world), None)


def _describe(hbs: dict[int, Heartbeat], world: int | None) -> str:
    if not hbs:
        return "starting ranks"
    steps = [hb.progress.get("step") for hb in hbs.values()]
    total = next((hb.progress.get("steps") for hb in hbs.values()), None)
    phase = next((hb.phase for hb in hbs.values()), None)
    if any(s is not None for s in steps) and total:
        lo = min(s for s in steps if s is not None)
        return f"step {lo}/{total}" + (f" ({phase})" if phase else "")
    up = len(hbs)
    return f"{up}/{world or up} ranks up" + (f", {phase}" if phase else "")


def watch(job: LaunchedJob, settings: WatchSettings, on_phase: Phase | None = None,
          quick_check: Callable[[dict[int, Heartbeat]], bool] | None = None,
          on_notice: Phase | None = None) -> Outcome:
    """Block (bounded by the job's own end, a stall, or the startup timeout) and say why."""
    say = on_phase or (lambda _s: None)
    notice = on_notice or say
    out = Outcome(kind="running", t_start=time.time())
    last_fp: dict[int, str] = {}
    last_cpu: dict[int, float] = {}
    last_move: dict[int, float] = {}
    clock = CpuClock()
    failed_at: float | None = None
    abnormal: list[int] = []
    t0 = time.monotonic()
    last_refresh = -1e9
    shown = ""
    straggling = False
    while True:
        now = time.monotonic()
        if now - last_refresh >= settings.refresh_s:
            job.refresh()  # new descendants, so that none can outlive us
            last_refresh = now
        rc = job.poll()
        hbs = read_heartbeats(settings.probe_dir)
        out.heartbeats = hbs
        for r, hb in hbs.items():
            if hb.pid is None:
                continue
            out.rank_pids[r] = hb.pid
            job.tracker.add(hb.pid)
        if rc is not None:
            out.kind = "completed" if rc == 0 else "failed"
            out.returncode = rc
            out.reason = f"torchrun exited with code {rc}"
            out.t_detect = time.time()
            _note_dead(out)
            return out
        world = settings.world or _local_world_from(hbs)
        if world and len(hbs) >= world and out.t_up is None:
            out.t_up = time.time()
            for r in hbs:
                last_move[r] = now
        if out.t_up is None and now - t0 > settings.startup_timeout_s:
            out.kind = "startup_timeout"
            out.reason = (f"only {len(hbs)} of {world or '?'} ranks started within "
                          f"{settings.startup_timeout_s:.0f} s")
            out.t_detect = time.time()
            return out
        # a rank died while the agent is still up: torchrun is tearing the job down. A rank
        # that finished (the others may still checkpoint or evaluate for minutes) is not that.
        for r, pid in out.rank_pids.items():
            if r not in out.dead_ranks and not is_alive(pid):
                out.dead_ranks[r] = time.time()
                if not _left_cleanly(RankFiles(settings.probe_dir, r), hbs.get(r)):
                    abnormal.append(r)
                    failed_at = failed_at or now
        if failed_at is not None and now - failed_at > settings.teardown_wait_s:
            out.kind = "failed"
            out.reason = f"rank {min(abnormal)} exited and torchrun did not end the job"
            out.t_detect = time.time()
            return out
        if out.t_up is not None and failed_at is None:
            for r, hb in hbs.items():
                if r not in out.rank_pids:
                    continue
                fp = hb.fingerprint()
                # CPU use counts as movement: a rank blocked in a collective burns next to
                # none (the probe's heartbeat is ~0.5 ms/s), while even a starved rank on a
                # loaded machine computes at a few percent of a core. Read it from /proc, not
                # from the heartbeat: a rank holding the GIL for seconds (a full GC, teardown
                # at exit) starves its probe thread but is busy, not stuck.
                measured = clock.seconds(out.rank_pids[r])
                cpu = measured if measured is not None else last_cpu.get(r, 0.0)
                used = cpu - last_cpu.get(r, cpu)
                rate = used / max(now - last_move.get(r, now), settings.poll_s)
                if fp != last_fp.get(r) or (used > CPU_MOVING_S and rate > CPU_MOVING_RATE):
                    last_move[r] = now
                    last_fp[r], last_cpu[r] = fp, cpu
            pending = any(hb.has_pending() for hb in hbs.values())
            all_pending = len(hbs) >= (world or 0) and all(hb.pending for hb in hbs.values())
            if settings.desync_fast_path and all_pending and quick_check and quick_check(hbs):
                out.kind, out.reason = "desync", "ranks wait in mismatched collectives"
                out.t_detect = time.time()
                out.onset_ns = onset_ns(hbs)
                return out
            idle_for = now - max(last_move.values()) if last_move else 0.0
            waiting = [r for r, hb in hbs.items() if hb.pending
                       and now - last_move.get(r, now) >= settings.stall_s]
            busy = [r for r in hbs if r not in waiting and r not in out.dead_ranks]
            if settings.straggler_notice and waiting and busy and idle_for < settings.stall_s:
                if not straggling:
                    notice(f"rank {','.join(map(str, sorted(busy)))} still computing while rank "
                        f"{','.join(map(str, sorted(waiting)))} wait: a straggler, not a hang "
                        "(still watching)")
                    straggling = True
            else:
                straggling = False
            idle_limit = settings.idle_stall_s or max(30.0, 3 * settings.stall_s)
            if (pending and idle_for >= settings.stall_s) or idle_for >= idle_limit:
                out.kind = "stalled"
                out.reason = (f"no progress on any rank for {idle_for:.1f} s"
                              + ("" if pending else " (and no collective pending)"))
                out.t_detect = time.time()
                out.onset_ns = onset_ns(hbs)
                return out
        text = _describe(hbs, world)
        if text != shown:
            say(text)
            shown = text
        time.sleep(settings.poll_s)


class ProgressSample:
    """Did each live rank move between two readings (heartbeat fingerprint or CPU time)?

    Used on ranks left orphaned by a dead agent: a job that was healthy when its launcher died
    keeps stepping, and a snapshot of ranks in flight (one in all_gather, one already in
    all_reduce) must not be read as a desync. A rank blocked in a collective burns next to no
    CPU and its heartbeat does not change."""

    def __init__(self, probe_dir: Path, pids: dict[int, int]):
        self.probe_dir, self.pids = probe_dir, dict(pids)
        self.t0 = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict[int, tuple[str, float | None]]:
        # the main thread's CPU only: the window covers the dump requests, which the probe's
        # own thread answers, with CPU, in a rank that is blocked all the same
        hbs = read_heartbeats(self.probe_dir)
        return {r: (hb.fingerprint() if (hb := hbs.get(r)) else "", main_thread_cpu(pid))
                for r, pid in self.pids.items()}

    def finish(self, min_window_s: float = 1.0) -> dict[int, bool]:
        """Bounded: waits at most ``min_window_s`` beyond the first reading."""
        time.sleep(max(0.0, min_window_s - (time.monotonic() - self.t0)))
        after = self._read()
        moved: dict[int, bool] = {}
        for r, (fp, cpu) in self.before.items():
            fp2, cpu2 = after[r]
            if cpu is None or cpu2 is None:
                continue  # gone meanwhile: the liveness check speaks for it
            moved[r] = fp2 != fp or cpu2 - cpu > CPU_MOVING_S
        return moved


def _left_cleanly(files: RankFiles, hb: Heartbeat | None) -> bool:
    """The rank's interpreter shut down normally: the probe's last beat says ``exiting`` and it
    left no exception and no fatal-signal dump (an abort or SIGKILL never says ``exiting``)."""
    if hb is None or not hb.said_exiting:
        return False
    if files.error.exists():
        return False
    try:
        return files.fatal.stat().st_size == 0
    except OSError:
        return True


def _local_world_from(hbs: dict[int, Heartbeat]) -> int | None:
    """How many ranks this node should see (LOCAL_WORLD_SIZE; WORLD_SIZE on one node)."""
    for hb in hbs.values():
        n = hb.local_world or hb.world
        if n:
            return n
    return None


def _note_dead(out: Outcome) -> None:
    for r, pid in out.rank_pids.items():
        if r not in out.dead_ranks and not is_alive(pid):
            out.dead_ranks[r] = time.time()
