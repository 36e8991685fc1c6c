"""Watch a running job through its ranks' heartbeats until it ends, crashes, stalls or desyncs.

A rank *waits* while it is inside a collective — a collective pending in the recorder's
``pg_status`` or its main thread inside ``torch.distributed`` — and nothing of it changes
(its heartbeat fingerprint: progress, recorder sequence numbers, main-thread frame), whatever
its CPU use: a rank blocked behind a hung NCCL kernel spins a core (docs/DESIGN.md §9). Outside
collectives, main-thread CPU counts as progress (a long matmul sits on one line). A heartbeat
that stopped beating says nothing: the rank's interpreter holds the GIL (a full garbage
collection, teardown at exit) and its CPU decides. The job has *stalled* when no live rank has
moved for ``stall_s`` seconds while one waits in a collective. A *desync* is declared sooner:
as soon as every rank's heartbeat shows a collective pending at the same sequence number with a
different op, size or dtype, nothing can ever complete.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang.evidence.activity import Activity
from moe_hang.evidence.heartbeats import read_heartbeats
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import collective_of
from moe_hang.evidence.vocab import JobState, StrEnum, who
from moe_hang.probe.layout import RankFiles
from moe_hang.runtime import discover
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.procs import is_alive, main_thread_cpu

Phase = Callable[[str], None]  # what a command shows as its live phase ("capturing stacks")
CPU_MOVING_S = 0.02
CPU_MOVING_RATE = 0.02  # of one core
BEAT_STALE_S = 1.0  # the probe beats every 0.25 s: silent this long, its rank holds the GIL
# nothing says how many ranks run on this node (no LOCAL_WORLD_SIZE: one srun or mpirun task
# per node that starts its node's ranks itself): the ranks here are up once no new one joined
# a group for this long and every process under the job that joined one has its heartbeat
SETTLE_S = 1.0


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


@dataclass
class _Rank:
    fp: str = ""
    beat: int = -1
    beat_at: float = 0.0  # monotonic time its beat number last changed
    cpu: float | None = None  # main-thread CPU seconds at the last movement
    moved_at: float = 0.0


class Monitor:
    """The watcher's state across polls: which rank last moved when, which died, what was
    reported. :meth:`run` blocks until something happens and says what; it can be called
    again after an event the command chose to live with (an uncertain stall, a capture on
    request), and then reports the next one."""

    def __init__(self, job: LaunchedJob, settings: WatchSettings, on_phase: Phase | None = None,
                 quick_check: Callable[[dict[int, Heartbeat]], bool] | None = None,
                 on_notice: Phase | None = None, sampler: Sampler | None = None):
        self.job, self.s = job, settings
        self.sampler = sampler  # None: ranks without the probe are only said, not sampled
        self.sampling = False
        self.last_scan = -1e9
        self.next_round = 0.0
        self.rounds = 0
        self.in_coll: set[int] = set()
        self.sample_note = False
        self.say = on_phase or (lambda _s: None)
        self.notice = on_notice or self.say
        self.quick_check = quick_check
        self.out = WatchEvent(kind=EventKind.RUNNING, t_start=time.time())
        self.ranks: dict[int, _Rank] = {}
        self.failed_at: float | None = None
        self.abnormal: list[int] = []
        self.t0 = time.monotonic()
        self.last_refresh = -1e9
        self.shown = ""
        self.straggling = False
        self.held_since: float | None = None  # a stall the command chose to wait out
        self.desync_seen = False
        self.attempt = 0  # torchrun's restart count of the ranks watched now
        self._joined: tuple[frozenset[int], float] = (frozenset(), 0.0)  # SETTLE_S
        self._settle_scan = -1e9

    # ------------------------------------------------------------------ the loop

    def run(self, stop: Callable[[], bool] = lambda: False) -> WatchEvent:
        """Block (bounded by the job's own end, an event, or the startup timeout); ``stop``
        (checked every poll) ends it with kind ``requested``."""
        while True:
            kind = self._poll()
            if kind is None and stop():
                kind = EventKind.REQUESTED
            if kind is not None:
                self.out.kind = kind
                self.out.t_detect = time.time()
                return self.out
            time.sleep(self.s.poll_s)

    def _while_held(self, now: float, moved: bool) -> EventKind | None:
        """A stall the command lives with: "resumed" once a rank moves, reported again as a
        stall once --hang-after has passed, else nothing."""
        assert self.held_since is not None
        if moved:
            self.out.stalled_for = now - self.held_since
            self.held_since = None
            return EventKind.RESUMED
        if self.s.hang_after_s and now - self.held_since >= self.s.hang_after_s:
            self.out.reason = (f"no progress on any rank for {now - self.held_since:.0f} s "
                               "(--hang-after)")
            return EventKind.STALLED
        return None

    def hold(self) -> None:
        """Live with the stall just reported: report it again only once ``hang_after`` is up
        (:meth:`held_for`), or "resumed" when a rank moves."""
        self.held_since = self.held_since or self._idle_since()

    def held_for(self) -> float:
        return time.monotonic() - self.held_since if self.held_since is not None else 0.0

    def moving(self, within_s: float) -> dict[int, bool]:
        """Which ranks moved in the last ``within_s`` seconds (what a multi-node watcher tells
        the other nodes); empty until every local rank is up."""
        now = time.monotonic()
        return {r: now - st.moved_at < within_s for r, st in self.ranks.items()}

    # ------------------------------------------------------------------ one poll

    def _poll(self) -> EventKind | None:
        now = time.monotonic()
        out, job = self.out, self.job
        if now - self.last_refresh >= self.s.refresh_s:
            job.refresh()  # new descendants, so that none can outlive us
            self.last_refresh = now
        rc = job.poll()
        hbs = read_heartbeats(self.s.probe_dir)
        attempt = max((hb.restart or 0 for hb in hbs.values()), default=0)
        if attempt > self.attempt:
            self._restarted(attempt, now)
        # a beat of an earlier attempt is stale: its rank is being replaced
        hbs = {r: hb for r, hb in hbs.items() if (hb.restart or 0) >= self.attempt}
        out.heartbeats = hbs
        for r, hb in hbs.items():
            if hb.pid is not None:
                out.rank_pids[r] = hb.pid
                job.tracker.add(hb.pid)
        if rc is not None:
            out.returncode = rc
            out.reason = f"torchrun exited with code {rc}"
            self._note_dead()
            return EventKind.COMPLETED if rc == 0 else EventKind.FAILED
        if self.s.watch_unprobed:
            if hbs and self.sampling:
                self._leave_sampling(now)
            elif not hbs:
                kind = self._sampled(now)
                if self.sampling:
                    return kind
        world = self.s.world or self._expected_here(hbs, now)
        if world and len(hbs) >= world and out.t_up is None:
            out.t_up = time.time()
            self.ranks = {r: _Rank(moved_at=now) for r in hbs}
        if out.t_up is None:
            if now - self.t0 > self.s.startup_timeout_s:
                out.reason = (f"only {len(hbs)} of {world or '?'} ranks started within "
                              f"{self.s.startup_timeout_s:.0f} s")
                return EventKind.STARTUP_TIMEOUT
            self._describe(hbs, world)
            return None
        # a rank raised and its probe holds it (multi-node watch): the job fails now, but is
        # captured first, every rank still in place
        held = sorted(r for r, hb in hbs.items() if hb.held and r not in out.dead_ranks
                      and (pid := out.rank_pids.get(r)) is not None and is_alive(pid))
        if held and not out.held:
            out.held = held
            out.reason, out.onset_ns = _raised(self.s.probe_dir, held)
            return EventKind.FAILED
        # a rank died while the agent is still up: torchrun is tearing the job down. A rank
        # that finished (the others may still checkpoint or evaluate for minutes) is not that.
        for r, pid in out.rank_pids.items():
            if r not in out.dead_ranks and not is_alive(pid):
                out.dead_ranks[r] = time.time()
                if not _left_cleanly(RankFiles(self.s.probe_dir, r), hbs.get(r)):
                    self.abnormal.append(r)
                    self.failed_at = self.failed_at or now
        if self.failed_at is not None:
            # torchrun restarts a failed worker group while it has restarts left: the next
            # attempt's ranks (a new restart count in their heartbeats) are no failure
            wait = (self.s.restart_wait_s if self.attempt < self.s.max_restarts
                    else self.s.teardown_wait_s)
            if now - self.failed_at > wait:
                out.reason = (f"rank {min(self.abnormal)} exited and torchrun did not end "
                              "the job")
                return EventKind.FAILED
            return None
        moved = self._movement(hbs, now)
        if self.held_since is not None:
            return self._while_held(now, moved)
        pending = any(hb.has_pending() for hb in hbs.values())
        all_pending = len(hbs) >= (world or 0) and all(hb.pending for hb in hbs.values())
        if (self.s.desync_fast_path and not self.desync_seen and all_pending
                and self.quick_check is not None and self.quick_check(hbs)):
            self.desync_seen = True
            out.reason, out.onset_ns = "ranks wait in mismatched collectives", onset_ns(hbs)
            return EventKind.DESYNC
        idle_for = now - self._idle_since()
        self._straggler_notice(hbs, now, idle_for)
        idle_limit = self.s.idle_stall_s or max(30.0, 3 * self.s.stall_s)
        if (pending and idle_for >= self.s.stall_s) or idle_for >= idle_limit:
            out.reason = (f"no progress on any rank for {idle_for:.1f} s"
                          + ("" if pending else " (and no collective pending)"))
            out.onset_ns = onset_ns(hbs)
            return EventKind.STALLED
        self._describe(hbs, world)
        return None

    def _restarted(self, attempt: int, now: float) -> None:
        """torchrun restarted the worker group: watch the new attempt's ranks from scratch."""
        out = self.out
        self.notice(f"torchrun restarted the ranks (restart {attempt}"
                    + (f" of {self.s.max_restarts}" if self.s.max_restarts >= attempt else "")
                    + "): watching the new attempt")
        self.attempt = out.restarts = attempt
        self.failed_at, self.abnormal = None, []
        out.dead_ranks.clear()
        out.rank_pids.clear()
        out.held = []
        out.t_up, self.ranks = None, {}
        self.desync_seen, self.held_since, self.straggling = False, None, False

    def _expected_here(self, hbs: dict[int, Heartbeat], now: float) -> int | None:
        """How many ranks this node runs: LOCAL_WORLD_SIZE, else WORLD_SIZE; where the world
        is larger than the ranks here and nothing says how many run here, the ranks that have
        joined once none joined for SETTLE_S and no process under the job that joined a group
        lacks its heartbeat."""
        n = _local_world_from(hbs)
        if n is None or len(hbs) >= n or any(hb.local_world for hb in hbs.values()):
            return n
        seen = frozenset(hbs)
        if seen != self._joined[0]:
            self._joined = (seen, now)
            return n
        if now - self._joined[1] < SETTLE_S or now - self._settle_scan < self.s.refresh_s:
            return n
        self._settle_scan = now
        beating = {hb.pid for hb in hbs.values()}
        if any(rp.pid not in beating for rp in discover.ranks_under(self.job.pid)):
            return n  # a rank without its heartbeat yet
        return len(hbs)

    # ------------------------------------------------------------------ by sampling
    # No heartbeat from ranks that run: the probe is not in them. Sample them instead, every
    # round_s: a window of py-spy samples and counters (as diagnose takes), and the same
    # stall rule as heartbeats: nothing moved for stall_s while a rank sits in a collective.

    def round_s(self) -> float:
        return max(1.0, self.s.stall_s / 2)

    def _sampled(self, now: float) -> EventKind | None:
        out = self.out
        if now - self.last_scan >= self.s.refresh_s:
            self.last_scan = now
            found = discover.ranks_under(self.job.pid)
            if not self.sampling:
                if not found or time.time() - min(r.create_time for r in found) \
                        < self.s.probe_grace_s:
                    return None
                self._enter_sampling(found, now)
            for rp in found:
                if out.rank_pids.get(rp.rank) != rp.pid:  # new, or restarted by torchrun
                    out.rank_pids[rp.rank] = rp.pid
                    out.dead_ranks.pop(rp.rank, None)
                    self.job.tracker.add(rp.pid)
                    self.ranks[rp.rank] = _Rank(moved_at=now)
        if not self.sampling:
            return None
        for r, pid in out.rank_pids.items():
            if r not in out.dead_ranks and not is_alive(pid):
                # no heartbeat says how it left: torchrun's exit code will (a rank that failed
                # makes it end the job)
                out.dead_ranks[r] = time.time()
        if now < self.next_round or self.sampler is None:
            return None
        live = {r: pid for r, pid in out.rank_pids.items() if r not in out.dead_ranks}
        if not live:
            return None
        seen = self.sampler(live)
        now = time.monotonic()
        self.next_round = now + self.round_s()
        return self._round(seen, now)

    def _enter_sampling(self, found: list[discover.RankProc], now: float) -> None:
        out = self.out
        self.sampling, out.sampled, out.t_up = True, True, time.time()
        out.world = next((r.world_size for r in found if r.world_size), None)
        out.local_world = next((int(r.env["LOCAL_WORLD_SIZE"]) for r in found
                                if r.env.get("LOCAL_WORLD_SIZE", "").isdigit()), None)
        cleared = all(not r.probe_dir for r in found)
        why = ("the job's script cleared the environment?" if cleared else
               "the job's script replaced PYTHONPATH, or runs python -I, -E or -S?")
        self.notice(f"the probe is not running in the ranks ({why}): watching by sampling "
                    f"instead (stacks and counters every {self.round_s():g} s)"
                    if self.sampler is not None else
                    f"the probe is not running in the ranks ({why}): a job over several nodes "
                    "is not watched by sampling, only its end is (keep watch's PYTHONPATH)")
        self.ranks = {}
        self.next_round = now

    def _leave_sampling(self, now: float) -> None:
        self.sampling = self.out.sampled = False
        self.out.t_up = None  # set again once every rank's heartbeat is in
        self.ranks = {}
        self.notice("the probe started in the ranks after all: watching by heartbeats")

    def _round(self, seen: dict[int, RoundRank], now: float) -> EventKind | None:
        out = self.out
        self.rounds += 1
        moved_any = False
        for r, rr in seen.items():
            st = self.ranks.setdefault(r, _Rank(moved_at=now))
            fp = json.dumps(rr.fingerprint, default=str)
            moved = bool(rr.moved) or (st.fp != "" and rr.fingerprint is not None
                                       and fp != st.fp)
            if rr.fingerprint is not None:
                st.fp = fp
            if rr.activity is not None:
                out.activity[r] = rr.activity
            if moved:
                st.moved_at = now
                moved_any = True
        self.in_coll = {r for r, rr in seen.items() if rr.in_collective}
        if not self.sample_note and seen and all(rr.moved is None for rr in seen.values()):
            err = next((rr.error for rr in seen.values() if rr.error), "nothing readable")
            self.notice(f"cannot sample the ranks either ({err}): only the job's end is "
                        "watched")
            self.sample_note = True
        if self.held_since is not None:
            return self._while_held(now, moved_any)
        idle_for = now - self._idle_since()
        waiting = sorted(r for r in self.in_coll if now - self.ranks[r].moved_at >= self.s.stall_s)
        busy = sorted(r for r in seen if r not in waiting and now - self.ranks[r].moved_at
                      < self.s.stall_s)
        self._straggling(waiting, busy, idle_for)
        idle_limit = self.s.idle_stall_s or max(30.0, 3 * self.s.stall_s)
        if self.rounds >= 2 and ((self.in_coll and idle_for >= self.s.stall_s)
                                 or idle_for >= idle_limit):
            out.reason = (f"no progress on any rank for {idle_for:.1f} s (by sampling: stacks "
                          "and counters)" + ("" if self.in_coll else
                                             " (and no rank in a collective)"))
            return EventKind.STALLED
        text = f"sampling {len(seen)} ranks (no probe)"
        if text != self.shown:
            self.say(text)
            self.shown = text
        return None

    def _straggling(self, waiting: list[int], busy: list[int], idle_for: float) -> None:
        if self.s.straggler_notice and waiting and busy and idle_for < self.s.stall_s:
            if not self.straggling:
                def who(rs: list[int]) -> str:
                    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

                self.notice(f"{who(busy)} still moving while {who(waiting)} "
                            f"wait{'s' if len(waiting) == 1 else ''} in a collective: a "
                            "straggler, not a hang (still watching)")
                self.straggling = True
        else:
            self.straggling = False

    def _movement(self, hbs: dict[int, Heartbeat], now: float) -> bool:
        """Update when each rank last moved; True if any did in this poll."""
        any_moved = False
        for r, hb in hbs.items():
            pid = self.out.rank_pids.get(r)
            st = self.ranks.setdefault(r, _Rank(moved_at=now, beat_at=now))
            if hb.beat != st.beat:
                # a beat seen for the first time may be old: its own clock says how old
                first = st.beat < 0
                st.beat = hb.beat
                st.beat_at = (now - (time.time() - hb.time) if hb.time is not None
                              else now - BEAT_STALE_S - 1.0) if first else now
            cpu = main_thread_cpu(pid) if pid is not None else None
            fp = hb.fingerprint()
            moved = fp != st.fp
            if not moved and cpu is not None and st.cpu is not None:
                used = cpu - st.cpu
                rate = used / max(now - st.moved_at, self.s.poll_s)
                busy = used > CPU_MOVING_S and rate > CPU_MOVING_RATE
                # in a collective, CPU proves nothing (a spin-wait burns it too) — unless the
                # heartbeat went silent: then the interpreter holds the GIL and works
                stale = now - st.beat_at > BEAT_STALE_S
                moved = busy and (stale or not in_collective(hb))
            if moved or st.cpu is None:
                st.fp, st.cpu = fp, cpu
            if moved:
                st.moved_at = now
                any_moved = True
        return any_moved

    def _idle_since(self) -> float:
        return max((st.moved_at for st in self.ranks.values()), default=time.monotonic())

    def _straggler_notice(self, hbs: dict[int, Heartbeat], now: float, idle_for: float) -> None:
        waiting = [r for r, hb in hbs.items() if hb.pending
                   and now - self.ranks[r].moved_at >= self.s.stall_s]
        busy = [r for r in hbs if r not in waiting and r not in self.out.dead_ranks]
        if self.s.straggler_notice and waiting and busy and idle_for < self.s.stall_s:
            if not self.straggling:
                w = who(waiting)
                self.notice(f"{who(busy)} still computing while {w} "
                            f"wait{'s' if len(waiting) == 1 else ''}: a straggler, not a hang "
                            "(still watching)")
                self.straggling = True
        else:
            self.straggling = False

    def _describe(self, hbs: dict[int, Heartbeat], world: int | None) -> None:
        text = _describe(hbs, world)
        if text != self.shown:
            self.say(text)
            self.shown = text

    def _note_dead(self) -> None:
        for r, pid in self.out.rank_pids.items():
            if r not in self.out.dead_ranks and not is_alive(pid):
                self.out.dead_ranks[r] = time.time()


def watch(job: LaunchedJob, settings: WatchSettings, on_phase: Phase | None = None,
          quick_check: Callable[[dict[int, Heartbeat]], bool] | None = None,
          on_notice: Phase | None = None) -> WatchEvent:
    """Block until the first event (see :class:`Monitor`)."""
    return Monitor(job, settings, on_phase, quick_check, on_notice).run()
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


def _raised(probe_dir: Path, ranks: list[int]) -> tuple[str, int | None]:
    """"rank 2 raised ValueError: corrupt shard 17" (its probe's record), and when."""
    try:
        err = json.loads(RankFiles(probe_dir, ranks[0]).error.read_text())
        what = f"{err['type']}: {str(err.get('message', ''))[:100]}".rstrip(": ")
        t = err.get("time")
        when = int(float(t) * 1e9) if isinstance(t, (int, float)) else None
    except (OSError, ValueError, KeyError, TypeError):
        what, when = "an exception", None
    more = f" (and {who(ranks[1:])})" if len(ranks) > 1 else ""
    return f"rank {ranks[0]} raised {what}{more}", when


def _attempt_of(path: Path) -> int | None:
    """The restart count an error record was written in (None: not said)."""
    try:
        v = json.loads(path.read_text()).get("restart")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) else None


def _left_cleanly(files: RankFiles, hb: Heartbeat | None) -> bool:
    """The rank's interpreter shut down normally: the probe's last beat says ``exiting`` and it
    left no exception and no fatal-signal dump (an abort or SIGKILL never says ``exiting``);
    an exception of an earlier attempt (torchrun restarted the workers) is not its own."""
    if hb is None or not hb.said_exiting:
        return False
    if files.error.exists() and not (
            hb.restart and (a := _attempt_of(files.error)) is not None and a < hb.restart):
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


def _note_dead(out: WatchEvent) -> None:
    for r, pid in out.rank_pids.items():
        if r not in out.dead_ranks and not is_alive(pid):
            out.dead_ranks[r] = time.time()
