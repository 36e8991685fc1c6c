"""``watch``'s loop when the job spans nodes (:func:`supervise`): every node acts alike, on the
one global verdict."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from moe_hang.analysis.diagnosis import Certainty, Diagnosis
from moe_hang.commands.multinode.node import Node
from moe_hang.commands.multinode.requests import ON_DEMAND
from moe_hang.commands.multinode.unknown import rank_list
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import rundir
from moe_hang.runtime.monitor import Monitor, Outcome
from moe_hang.runtime.procs import is_alive

if TYPE_CHECKING:
    from moe_hang.commands.watch import WatchOptions


def supervise(node: Node, mon: Monitor, layout: RunLayout, cmd: list[str],
              say: Callable[[str], None], notice: Callable[[str], None], opts: WatchOptions,
              asked: threading.Event) -> tuple[Outcome, Diagnosis | None]:
    """``watch``'s loop when the job spans nodes (single node: ``watch._supervise``). The same
    rules, decided on the one global verdict so that every node acts alike: a definite
    verdict ends the job everywhere; an uncertain stall is watched on everywhere; a capture on
    request (SIGUSR1 on any watcher) ends nothing. A stall while ranks of other nodes still
    move is a straggler there, not a hang."""
    from moe_hang.commands import watch as w

    kept: Diagnosis | None = None
    recheck_at: float | None = None  # a straggler elsewhere: when to look at it again

    def stop() -> bool:
        if asked.is_set() or node.tick(mon):
            return True
        return recheck_at is not None and time.monotonic() >= recheck_at

    while True:
        outcome = mon.run(stop=stop)
        if outcome.kind == "resumed":
            recheck_at = None
            notice(f"resumed after {outcome.stalled_for:.1f} s")
            continue
        if outcome.kind == "completed":
            node.close(final={r: True for r in outcome.rank_pids})
            return outcome, kept
        held = mon.held_since is not None
        kind = outcome.kind
        remote = node.co is not None and node.co.capture_requested() is not None
        if kind == "requested" and not asked.is_set() and not remote and recheck_at is not None:
            # the straggler watched on: still moving there? (a node whose watcher died stops
            # publishing, and its last summary goes stale: not moving)
            kind, outcome.kind = "stalled", "stalled"
            outcome.reason = f"no progress on any rank for {mon.held_for():.1f} s"
        elif kind == "requested":
            asked.clear()
        elif kind == "stalled" and held:
            kind = "final"
        recheck_at = None
        if kind == "stalled" and not remote and node.co is not None:
            elsewhere = node.moving_elsewhere()
            if elsewhere:
                where = "; ".join(f"{rank_list(rs)} on node {h}" for h, rs in elsewhere.items())
                if not held:
                    notice(f"{rank_list(outcome.heartbeats)} wait while {where} still move: "
                           "a straggler there, not a hang (still watching)")
                mon.hold()
                recheck_at = time.monotonic() + node.summary_lag_s()
                continue
        alive = {r: is_alive(pid) for r, pid in outcome.rank_pids.items()}
        if kind == "failed" and not any(alive.values()) and node.co is None:
            node.close()
            return outcome, kept  # the job ended by itself, alone: diagnose what it left
        got = node.run_round(mon, outcome, kind, functools.partial(
            w._capture_and_diagnose, outcome, layout, cmd, say, opts))
        diag, rk = got.diagnosis, got.kind
        if rk in ON_DEMAND:
            notice(f"on request: {diag.verdict}: {diag.summary[:160]} ({layout.diagnosis})")
            rundir.write_json(layout.diagnosis, diag.to_dict())
            node.next_round()
            continue
        if rk == "stalled" and diag.certainty == Certainty.UNCERTAIN:
            unknown = diag.rule == "waits_on_unknown_ranks"
            notice(f"{diag.summary} (not ended: still watching)" if unknown
                   else w._waiting_line(diag, opts.stall_s))
            mon.hold()
            node.next_round()
            continue
        if opts.keep_running and rk in ("stalled", "desync", "final"):
            notice(f"{diag.verdict}: {diag.summary[:160]} — the job keeps running "
                   "(--keep-running)")
            kept = diag
            mon.s.hang_after_s = 0.0
            mon.hold()
            node.next_round()
            continue
        return outcome, diag
