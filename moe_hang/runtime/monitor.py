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

import time
from collections.abc import Callable

from moe_hang.evidence.heartbeats import read_heartbeats
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.vocab import who
from moe_hang.probe.layout import RankFiles
from moe_hang.runtime import discover
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.procs import is_alive, main_thread_cpu
from moe_hang.runtime.progress import CPU_MOVING_S
from moe_hang.runtime.rankfate import left_cleanly, local_world_from, raised_by
from moe_hang.runtime.sampled import RankMotion, SamplingWatch
from moe_hang.runtime.watchevent import (
    EventKind,
    Phase,
    Sampler,
    WatchEvent,
    WatchSettings,
    in_collective,
    onset_ns,
)

CPU_MOVING_RATE = 0.02  # of one core


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


class Monitor(SamplingWatch):
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
        self.ranks: dict[int, RankMotion] = {}
        self.failed_at: float | None = None
        self.abnormal: list[int] = []
        self.t0 = time.monotonic()
        self.last_refresh = -1e9
        self.shown = ""
        self.straggling = False
        self.held_since: float | None = None  # a stall the command chose to wait out
        self.desync_seen = False
        self.attempt = 0  # torchrun's restart count of the ranks watched now
        self._joined: tuple[frozenset[int], float] = (frozenset(), 0.0)  # timings.settle_s
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

    def moving_s(self) -> float:
        """A rank whose heartbeat moved this recently is moving now (never more than half of
        --stall)."""
        return self.s.timings.moving_within(self.s.stall_s)

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
            self.ranks = {r: RankMotion(moved_at=now) for r in hbs}
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
            out.reason, out.onset_ns = raised_by(self.s.probe_dir, held)
            return EventKind.FAILED
        # a rank died while the agent is still up: torchrun is tearing the job down. A rank
        # that finished (the others may still checkpoint or evaluate for minutes) is not that.
        for r, pid in out.rank_pids.items():
            if r not in out.dead_ranks and not is_alive(pid):
                out.dead_ranks[r] = time.time()
                if not left_cleanly(RankFiles(self.s.probe_dir, r), hbs.get(r)):
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
        joined once none joined for ``timings.settle_s`` and no process under the job that
        joined a group lacks its heartbeat."""
        n = local_world_from(hbs)
        if n is None or len(hbs) >= n or any(hb.local_world for hb in hbs.values()):
            return n
        seen = frozenset(hbs)
        if seen != self._joined[0]:
            self._joined = (seen, now)
            return n
        if now - self._joined[1] < self.s.timings.settle_s \
                or now - self._settle_scan < self.s.refresh_s:
            return n
        self._settle_scan = now
        beating = {hb.pid for hb in hbs.values()}
        if any(rp.pid not in beating for rp in discover.ranks_under(self.job.pid)):
            return n  # a rank without its heartbeat yet
        return len(hbs)

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
            st = self.ranks.setdefault(r, RankMotion(moved_at=now, beat_at=now))
            if hb.beat != st.beat:
                # a beat seen for the first time may be old: its own clock says how old
                first = st.beat < 0
                st.beat = hb.beat
                st.beat_at = (now - (time.time() - hb.time) if hb.time is not None
                              else now - self.s.timings.beat_stale_s - 1.0) if first else now
            cpu = main_thread_cpu(pid) if pid is not None else None
            fp = hb.fingerprint()
            moved = fp != st.fp
            if not moved and cpu is not None and st.cpu is not None:
                used = cpu - st.cpu
                rate = used / max(now - st.moved_at, self.s.poll_s)
                busy = used > CPU_MOVING_S and rate > CPU_MOVING_RATE
                # in a collective, CPU proves nothing (a spin-wait burns it too) — unless the
                # heartbeat went silent: then the interpreter holds the GIL and works
                stale = now - st.beat_at > self.s.timings.beat_stale_s
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
        # "still computing" is a rank moving now, not one that last moved just after the
        # waiter posted (it went to sleep a moment later: the stall is seconds away)
        busy = [r for r in hbs if r not in waiting and r not in self.out.dead_ranks
                and now - self.ranks[r].moved_at < self.moving_s()]
        if self.s.straggler_notice and waiting and busy and idle_for < self.s.stall_s:
            if not self.straggling:
                w = who(waiting)
                self.notice(f"{who(busy)} still computing while {w} "
                            f"wait{'s' if len(waiting) == 1 else ''}: a straggler, not a hang "
                            "(still watching)")
                self.straggling = True
        elif not waiting:  # said once while they wait, however the straggler's pace varies
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


def _note_dead(out: WatchEvent) -> None:
    for r, pid in out.rank_pids.items():
        if r not in out.dead_ranks and not is_alive(pid):
            out.dead_ranks[r] = time.time()
