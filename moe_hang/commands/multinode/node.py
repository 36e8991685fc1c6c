"""This watcher's part of a multi-node job (:class:`Node`): the channel, registration,
summaries, and one round from a capture to the verdict every node prints."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.runs import RunInfo, WatchRun
from moe_hang.commands.multinode.channel import NodeChannel
from moe_hang.commands.multinode.connect import Plan
from moe_hang.commands.multinode.requests import reason_text, request_kind
from moe_hang.commands.multinode.summaries import capture_summary, merge_remote, raw_heartbeats
from moe_hang.commands.session import record_source
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Unreached
from moe_hang.evidence.vocab import RankState
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import coord, rundir
from moe_hang.runtime.coord import (
    CaptureRequest,
    Coordinator,
    GlobalVerdict,
    NodeSummary,
)
from moe_hang.runtime.coord.relay import Relay
from moe_hang.runtime.monitor import Monitor
from moe_hang.runtime.procs import is_alive
from moe_hang.runtime.watchevent import FROZEN, EventKind, WatchEvent, world_of
from moe_hang.settings import Settings

if TYPE_CHECKING:
    from moe_hang.runtime.launcher import LaunchedJob


@dataclass
class RoundOutcome:
    diagnosis: Diagnosis  # the one every node prints
    kind: EventKind  # what the round was for (request_kind): decides whether the job is ended
    verdict: GlobalVerdict


class Node(NodeChannel):
    """This watcher's part: a channel connected in the background, registration once the
    local ranks are up, summaries offered from the watch loop (no I/O there), and rounds."""

    def __init__(self, p: Plan, layout: RunLayout, notice: Callable[[str], None], *,
                 timings: Settings, hold_s: float | None, stall_s: float = 10.0) -> None:
        self.plan, self.layout, self.notice, self.timings = p, layout, notice, timings
        # how long a rank that raised is held (timings.hold_s); None: it ends at once
        # (--keep-running; torchrun may restart it)
        self.hold_s = hold_s
        # "moving" in a summary: moved this recently (well inside --stall, so that ranks that
        # just entered the collective the others wait in are not read as computing)
        self.moving_s = timings.moving_within(stall_s)
        self.publish_s = 2.0
        self.host = socket.gethostname()
        self.co: Coordinator | None = None
        self.node = ""
        self.world: int | None = None
        self.local_world: int | None = None
        self.local_ranks: list[int] = []
        self.why_local: str | None = None  # why there is no channel
        self.last_round: GlobalVerdict | None = None  # the global verdict of the last round
        self.job: LaunchedJob | None = None
        self._up = threading.Event()
        self._ready = threading.Event()  # the channel is open, or will not be
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_offer = 0.0
        self._run_info: RunInfo | None = None  # this node's own record (command, timings)
        self._relay: Relay | None = None  # the watchers' own store, where this node serves it
        self._on_relay = False  # this node talks in the relay (not in the job's store)
        self._hosts = False  # this node's job hosts the job's store
        self._fallback: threading.Thread | None = None  # back to the job's store (_fall_back)

    # ------------------------------------------------------------------ background

    def attach(self, job: LaunchedJob) -> None:
        """After the job started. torch (for the store client) is imported here, in the main
        thread, while the job starts up: never half-way in a daemon thread at exit."""
        self.job = job
        if self.hold_s:
            # a rank that raised stays (bounded) until every node has captured and has the
            # verdict: its exit would end its peers and launchers, the store's host with them
            rundir.write_json(self.layout.hold, {"watcher": os.getpid(), "limit_s": self.hold_s})
        if self.plan.shared_dir is None:
            coord.preload_torch()
        self._thread = threading.Thread(target=self._run, name="moe-hang-multinode",
                                        daemon=True)
        self._thread.start()

    def expected(self) -> list[str]:
        return coord.expected_nodes(self.world, self.local_world)

    def _raw_heartbeats(self) -> dict[int, dict[str, Any]]:
        return raw_heartbeats(self.layout)

    def tick(self, mon: Monitor) -> bool:
        """Every poll of the watch loop: in memory only (the coordinator's thread does the
        I/O). True when a capture request is waiting (another node's, or a diagnose)."""
        out = mon.out
        if not self._up.is_set():
            # up by sampling is not up here: the ranks' heartbeats name this node and the
            # world, and a probe that starts late (a loaded machine) brings them after all
            if out.t_up is None or out.sampled:
                return False
            hbs = self._raw_heartbeats()
            self.local_ranks = sorted(out.heartbeats)
            self.world = world_of(out.heartbeats)
            lw = next((hb.local_world for hb in out.heartbeats.values() if hb.local_world),
                      None)
            self.local_world = lw or len(self.local_ranks)
            # where the ranks run (a watcher outside their container sees another name)
            self.host = next((str(hb["host"]) for hb in hbs.values() if hb.get("host")),
                             self.host)
            self.node = (coord.node_id_from_heartbeats(hbs) or block_of(self.local_ranks)
                         or coord.sanitize(self.host))
            self._up.set()
        co = self.co
        if co is None:
            return False
        if co.gone and self._on_relay and self._fallback is None and not self._closed.is_set():
            self._on_relay = False
            self._fallback = threading.Thread(target=self._fall_back, args=(co.gone,),
                                              name="moe-hang-fallback", daemon=True)
            self._fallback.start()
        now = time.monotonic()
        if now - self._last_offer >= self.timings.summary_offer_s:
            self._last_offer = now
            co.offer_summary(self.summary(mon))
        return co.capture_requested() is not None

    def summary(self, mon: Monitor, *, kind: str = "periodic",
                moving: Mapping[int, bool] | None = None) -> NodeSummary:
        alive = {r: is_alive(pid) for r, pid in mon.out.rank_pids.items()}
        return coord.summarize_heartbeats(
            self._raw_heartbeats(), node=self.node, host=self.host,
            moving=mon.moving(self.moving_s) if moving is None else moving, alive=alive,
            kind=kind)

    def summary_lag_s(self) -> float:
        """How late a summary can say that a rank stopped moving: the watch loop offers one
        every ``summary_offer_s``, the coordinator publishes a changed one at most every
        publish_s, on its next beat (1 s)."""
        return self.timings.summary_offer_s + self.publish_s + 1.0 + self.moving_s + 0.5

    def moving_elsewhere(self) -> dict[str, list[int]]:
        """Host -> its ranks that moved lately, from the other nodes' summaries (bounded).
        Summaries lag: ranks that moved are looked at again once a fresh summary would say
        they stopped (unless a capture request comes first)."""
        found = self._moving_elsewhere()
        co = self.co
        if found and co is not None and not co.request_event.wait(self.summary_lag_s()):
            found = self._moving_elsewhere()
        return found if co is None or co.capture_requested() is None else {}

    def _moving_elsewhere(self) -> dict[str, list[int]]:
        co = self.co
        if co is None:
            return {}
        sums = co.read_summaries()
        moving = set(coord.remote_moving(sums, self.node))
        out: dict[str, list[int]] = {}
        for n, s in sums.items():
            rs = sorted(r.rank for r in s.ranks if r.rank in moving)
            if rs and n != self.node:
                out[s.host or n] = rs
        return out

    def close(self, final: Mapping[int, bool] | None = None) -> None:
        """Stop; ``final``: the local ranks ended (rank -> cleanly): said once more first, so
        that a later round knows they finished instead of naming them unknown."""
        with self._lock:
            self._closed.set()
            co = self.co
        try:
            if co is not None:
                self._close_coordinator(co, final)
            self._join()
        finally:
            if self._relay is not None:
                self._relay.close()

    def _close_coordinator(self, co: Coordinator, final: Mapping[int, bool] | None) -> None:
        if final is not None:
            hbs = self._raw_heartbeats()
            s = coord.summarize_heartbeats(hbs, node=self.node, host=self.host,
                                           alive=dict.fromkeys(hbs, False), kind="periodic")
            co.publish_summary(s)
        co.close()

    def _join(self) -> None:
        """The background thread may be inside a store connect (C++, GIL released): a thread
        that comes back from one while the interpreter shuts down aborts the watcher
        ("terminate called without an active exception"). Each attempt is bounded, and the
        thread stops between attempts once closed."""
        for t in (self._thread, self._fallback):
            if t is not None and t is not threading.current_thread():
                t.join(self.timings.channel_join_s)

    def next_round(self) -> None:
        if self.co is not None:
            self.co.next_round()

    # ------------------------------------------------------------------ a round

    def _capture_summary(self, mon: Monitor, outcome: WatchEvent) -> NodeSummary:
        alive = {r: is_alive(pid) for r, pid in outcome.rank_pids.items()}
        if outcome.kind in FROZEN:
            moving = dict.fromkeys(alive, False)  # by construction nothing moved
        else:
            moving = {r: outcome.progressed[r] for r in outcome.progressed}
        return capture_summary(self.layout, self.node, self.host, moving=moving, alive=alive)

    def _analyse(self, summaries: dict[str, NodeSummary], missing: list[str], kind: EventKind,
                 req: CaptureRequest | None) -> dict[str, Any]:
        """On the node that analyses: its own capture plus every other node's summary; the
        ranks of nodes that did not answer are unreached (never blamed)."""
        ev = load_capture(self.layout.root, world=self.world, job=kind.job)
        # this round's captures only: one of an earlier round is not what this verdict says
        shutil.rmtree(self.layout.coord_nodes, ignore_errors=True)
        merge_remote(ev, {n: s for n, s in summaries.items() if n != self.node},
                     into=self.layout.coord_nodes)
        if self.layout.coord_nodes.is_dir():
            rundir.write_json(self.layout.coord_nodes_round, {"request": req.id if req else None})
        co = self.co
        hosts = {n: s.host for n, s in summaries.items()}
        if co is not None and (missing or (self.world and len(ev.ranks) < self.world)):
            for n, info in co.nodes().items():
                hosts.setdefault(n, info.host)
            # a node whose job finished said so before its watcher left: not unknown
            done = {n: s for n, s in co.read_summaries(missing).items()
                    if s.ranks and all(r.state == RankState.EXITED for r in s.ranks)}
            merge_remote(ev, done)
        if self.world:
            ev.world_size = self.world
        unknown = unreached_ranks(self.world, ev.ranks)
        if unknown:
            ev.unreached = Unreached(unknown, local_world=self.local_world, hosts=hosts)
        if kind == EventKind.FINAL:
            ev.held = reason_text(req)
        record_source(self.layout, ev)
        diag = diagnose(ev)
        self.layout.coord_dir.mkdir(mode=0o700, exist_ok=True)
        rundir.write_json(self.layout.coord_analysis, diag.to_dict())
        d = diag.to_dict()
        d["artifacts"] = ""  # every node's own run directory
        return d

    def run_round(self, mon: Monitor, outcome: WatchEvent, kind: EventKind,
                  capture_local: Callable[[], Diagnosis]) -> RoundOutcome:
        """Capture here, the same on every node, one verdict; returns once this node may end
        its job (the store's host after every other node has the verdict)."""
        if self.co is None and self._thread is not None:
            # still connecting: a rank raised early in the job
            self._ready.wait(self.timings.round_ready_s)
        co = self.co
        req: CaptureRequest | None = None
        if co is not None:
            req = co.capture_requested() or co.request_capture(f"{kind}: {outcome.reason}")
        local_kind = kind

        def capture() -> NodeSummary:
            self._await_launcher_report(outcome)
            local = capture_local()
            self._run_info = local.run
            self.layout.coord_dir.mkdir(mode=0o700, exist_ok=True)
            rundir.write_json(self.layout.coord_local,
                              local.to_dict())
            rundir.snapshot_capture(self.layout)  # (the watch's capture took one: anew)
            return self._capture_summary(mon, outcome)

        if co is None or req is None:
            why = (co.gone if co is not None else None) or self.why_local or (
                f"not connected to {self.plan.describe()} yet")
            mine = capture()
            others = [n for n in self.expected() if n != self.node]
            d = self._analyse({self.node: mine}, others, local_kind, None)
            gv = GlobalVerdict(request="local", by_node=self.node, time=time.time(), verdict_data=d,
                               captured=[self.node], missing=others,
                               hosts={self.node: self.host},
                               unknown_ranks=unreached_ranks(self.world, self.local_ranks),
                               local_only=True, note=f"{why}: local ranks only",
                               _summaries={self.node: mine})
            self.notice(f"no other node reachable ({why}): a verdict from this node's ranks "
                        "only")
        else:
            rk = request_kind(req)
            if req.by_node != self.node:
                self.notice(f"capture requested by node {req.by_node} ({req.host}): "
                            f"{reason_text(req)[:120]}")
            res = co.run_round(req, capture,
                               lambda s, m: self._analyse(s, m, rk, req),
                               self.expected(), world=self.world)
            gv, local_kind = res.verdict, rk
            if gv.local_only:
                self.notice(f"{gv.note}: a verdict from this node's ranks only")
            else:
                nodes = ", ".join(f"{n} ({h})" for n, h in sorted(gv.hosts.items(),
                                                                 key=lambda kv: kv[0]))
                unk = f"; unknown: node {', '.join(gv.missing)}" if gv.missing else ""
                self.notice(f"one verdict for the job from nodes {nodes}{unk} "
                            f"(analysed by node {gv.by_node}, "
                            f"{res.timings.get('verdict', 0.0):.1f} s after the request)")
                if res.not_ended:
                    self.notice(f"nodes {', '.join(res.not_ended)} did not confirm in time; "
                                "ending this node's job (it hosts the store) anyway")
        self.last_round = gv
        diag = Diagnosis.from_dict(gv.verdict)
        diag.artifacts = str(self.layout.root)
        diag.run = self._run_info
        if isinstance(diag.run, WatchRun) and outcome.onset_ns:
            diag.run.timings.onset_to_verdict_s = round(time.time() - outcome.onset_ns / 1e9, 3)
        self.layout.coord_dir.mkdir(mode=0o700, exist_ok=True)
        rundir.write_json(self.layout.coord_verdict, gv.to_json())
        return RoundOutcome(diag, local_kind, gv)

    def _await_launcher_report(self, outcome: WatchEvent) -> None:
        """A rank here is gone and its launcher is not yet: torchrun writes each rank's exit
        code (the signal that killed it) into its failure report as it exits, a moment later.
        The capture waits for that (bounded) rather than call the rank gone without one."""
        job = self.job
        if job is not None and not all(is_alive(pid) for pid in outcome.rank_pids.values()):
            job.wait_exit(self.timings.launcher_report_s)

    def finish(self, ended_after_verdict: bool) -> None:
        """After the job ended: where a verdict ended it, the run directory keeps the capture
        it came from (ranks/, job.log up to then); what came after is in teardown/."""
        if not ended_after_verdict:
            rundir.drop_snapshot(self.layout)
        elif (why := rundir.keep_capture(self.layout)) is not None:
            self.notice(why)


def block_of(ranks: list[int]) -> str | None:
    """The node a block of consecutive global ranks is, counted in blocks of its size (no
    launcher said how many ranks a node runs: srun or mpirun with one task per node that
    starts its ranks); None for ranks that are no such block."""
    n = len(ranks)
    if not n or ranks != list(range(ranks[0], ranks[0] + n)) or ranks[0] % n:
        return None
    return str(ranks[0] // n)


def unreached_ranks(world: int | None, known: Iterable[int]) -> list[int]:
    """The ranks of the world nothing is known of."""
    return sorted(set(range(world)) - set(known)) if world else []
