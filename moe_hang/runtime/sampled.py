"""Watching ranks that run without the probe (:class:`SamplingWatch`, a part of
:class:`~moe_hang.runtime.monitor.Monitor`): no heartbeat comes from ranks that run, so they
are sampled instead, every :meth:`~SamplingWatch.round_s` — a window of py-spy samples and
counters, as ``diagnose`` takes — under the same stall rule as heartbeats: nothing moved for
``stall_s`` while a rank sits in a collective."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from moe_hang.runtime import discover
from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.procs import is_alive
from moe_hang.runtime.watchevent import (
    EventKind,
    Phase,
    RoundRank,
    Sampler,
    WatchEvent,
    WatchSettings,
)


@dataclass
class RankMotion:
    """When a watched rank last moved, and what it looked like then."""

    fp: str = ""
    beat: int = -1
    beat_at: float = 0.0  # monotonic time its beat number last changed
    cpu: float | None = None  # main-thread CPU seconds at the last movement
    moved_at: float = 0.0


class SamplingWatch:
    """The sampling half of the watcher's state; :class:`~moe_hang.runtime.monitor.Monitor`
    holds the rest (and the methods this part calls back)."""

    job: LaunchedJob
    s: WatchSettings
    out: WatchEvent
    sampler: Sampler | None
    sampling: bool
    last_scan: float
    next_round: float
    rounds: int
    in_coll: set[int]
    sample_note: bool
    shown: str
    held_since: float | None
    ranks: dict[int, RankMotion]
    say: Phase
    notice: Phase
    _while_held: Callable[[float, bool], EventKind | None]
    _idle_since: Callable[[], float]
    _straggling: Callable[[list[int], list[int], float], None]

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
                    self.ranks[rp.rank] = RankMotion(moved_at=now)
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
            st = self.ranks.setdefault(r, RankMotion(moved_at=now))
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
