"""Multi-node ``watch`` and ``diagnose``: one watcher per node, one verdict for the job.

Each node's ``moe-hang watch`` is the parent of that node's torchrun agent and sees only its
own ranks. The watchers coordinate through the store the job already has (torchrun's
rendezvous endpoint) or a directory every node sees (``--shared-dir``), under
``moe-hang/<run key>/`` (:mod:`moe_hang.runtime.coord`): each publishes a compact summary of
its ranks; the first watcher to see a stall, a desync or a failure posts a capture request;
every node captures its own ranks and publishes the result; one node (the requester) analyses
its own capture plus the others' summaries and publishes the verdict; every node prints that
same verdict and saves it; nobody ends anything before that (or before a bounded deadline),
and the node hosting the store ends its job last.

What is not known is not blamed: the ranks of a node whose watcher never answered are
*unknown*, and a verdict that would blame known ranks for waiting on unknown ones becomes a
sentence saying whom they wait for and where to look (:func:`guard_unknown`).

Nothing here runs unless the job is multi-node (its torchrun command line says so) or
``--shared-dir`` is given: a single-node ``watch`` never imports torch and behaves as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_hang.analysis.diagnosis import (
    NO_PROBLEM,
    Certainty,
    CulpritBasis,
    Diagnosis,
    Divergence,
    MismatchKind,
    RankCollective,
    RankReport,
    RankState,
    RunInfo,
    Timeline,
    TimelineCell,
    Verdict,
    WatchRun,
    pg_label,
    spans,
)
from moe_hang.analysis.rules import diagnose
from moe_hang.errors import MoeHangError
from moe_hang.evidence import frtrace
from moe_hang.evidence.frtrace import DEFAULT_PG, Collective, FRDump, PgStatus
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Evidence, Heartbeat, RankEvidence
from moe_hang.evidence.ops import normalise_dtype, normalise_op
from moe_hang.evidence.stacks import Frame, is_library_frame
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import coord, rundir
from moe_hang.runtime.coord import (
    CaptureRequest,
    Channel,
    Coordinator,
    DirChannel,
    GlobalVerdict,
    NodeSummary,
    PendingCollective,
    RankSummary,
    StoreChannel,
    StoreEndpoint,
)
from moe_hang.runtime.monitor import Monitor, Outcome, world_of
from moe_hang.runtime.procs import is_alive

if TYPE_CHECKING:
    from moe_hang.commands.watch import WatchOptions
    from moe_hang.runtime.launcher import LaunchedJob

# run directory: what the coordination adds (docs/DESIGN.md §7)
# verdict.json (the global verdict and set), local-diagnosis.json (this node's own view),
# analysis.json (on the node that analysed: the engine's verdict before unknown ranks)
COORD_DIR = "coord"
SNAPSHOT_DIR = ".capture"  # the ranks' files as captured, while the job is being ended
TEARDOWN_DIR = "teardown"  # what the ranks and the job wrote after the capture

CONNECT_S = 24 * 3600.0  # the store appears when the head node's agent starts: keep trying
MOVING_S = 5.0  # a rank that moved this recently is "moving" in its node's summary
OFFER_S = 1.0  # how often the watch loop hands a fresh summary to the coordinator
FRESH_S = 30.0  # diagnose: an older periodic summary says nothing about now
HISTORY_PER_GROUP = 8  # a capture summary: each rank's last collectives per group
MAX_USER_FRAMES = 12
# what the request's kind makes of the job: the analysis' job kind
_JOB_OF = {"stalled": "stalled", "final": "stalled", "desync": "desync", "failed": "failed"}
# request kinds after which nothing is ended (a capture on demand)
ON_DEMAND = ("requested", "diagnose")


# ----------------------------------------------------------------------------- set-up


@dataclass
class Plan:
    """How this watcher reaches the others: the job's store, or a shared directory."""

    endpoint: StoreEndpoint | None
    shared_dir: Path | None
    run: str  # the run key: moe-hang/<run>/ in the channel

    def describe(self) -> str:
        if self.shared_dir is not None:
            return f"shared directory {self.shared_dir}"
        assert self.endpoint is not None
        return f"the job's store {self.endpoint.host}:{self.endpoint.port}"


def check_shared_dir(path: str | os.PathLike[str]) -> Path:
    """``--shared-dir``: an existing directory this user can write (tried, not guessed)."""
    p = Path(path)
    if not p.is_dir():
        raise MoeHangError(f"--shared-dir {p}: not a directory (create it on a file system "
                           "every node sees)")
    try:
        fd, name = tempfile.mkstemp(prefix=".moe-hang-check-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise MoeHangError(f"--shared-dir {p}: not writable ({exc.strerror})") from None
    return p.resolve()


def plan(cmd: Sequence[str], shared_dir: str | os.PathLike[str] | None,
         env: Mapping[str, str] | None = None) -> Plan | None:
    """None for a single-node job without ``--shared-dir``: nothing to coordinate."""
    ep = coord.endpoint_from_torchrun(cmd, env)
    if shared_dir is None and (ep is None or not ep.multi_node):
        return None
    sd = check_shared_dir(shared_dir) if shared_dir is not None else None
    return Plan(ep, sd, coord.run_key(ep.run_id if ep else None, env))


def open_channel(p: Plan, *, connect_s: float, stop: threading.Event | None = None
                 ) -> tuple[Channel | None, str | None]:
    """(channel, None) or (None, why not)."""
    if p.shared_dir is not None:
        return DirChannel(p.shared_dir, p.run), None
    assert p.endpoint is not None
    ep = p.endpoint
    ch = StoreChannel(ep.host, ep.port, p.run)
    if ch.connect(timeout=connect_s, stop=stop):
        return ch, None
    ch.close()
    return None, (f"the job's store {ep.host}:{ep.port} is not reachable from here "
                  "(give every watcher --shared-dir DIR)")


# ----------------------------------------------------------------------------- evidence


def history_of(dump: FRDump, per_group: int = HISTORY_PER_GROUP
               ) -> tuple[list[PendingCollective], dict[str, list[int]]]:
    """A rank's recent collectives for its capture summary: the last ``per_group`` of each
    group from its Flight Recorder dump (user frames only), and each group's status by name."""
    out: list[PendingCollective] = []
    for pg, entries in dump.by_pg().items():
        for c in entries[-per_group:]:
            out.append(PendingCollective(
                op=c.raw_op or c.op, seq=c.seq, pg_id=pg, pg=pg, pg_desc=c.pg_desc or None,
                input_sizes=c.input_sizes, output_sizes=c.output_sizes, dtypes=c.dtypes,
                t_ns=c.time_created_ns, completed=c.completed,
                frames=[f"{f.file}:{f.line}:{f.function}" for f in c.frames
                        if not is_library_frame(f)][:MAX_USER_FRAMES]))
    status = {pg: [st.enqueued, st.completed] for pg, st in dump.pg_status.items()}
    return out, status


def raw_heartbeats(layout: RunLayout) -> dict[int, dict[str, Any]]:
    """The ranks' heartbeats as the probe wrote them (what summaries are made of)."""
    out: dict[int, dict[str, Any]] = {}
    for p in layout.ranks_dir.glob("rank*.hb.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
    return out


def capture_summary(layout: RunLayout, node: str, host: str | None, *,
                    moving: Mapping[int, bool] | None,
                    alive: Mapping[int, bool] | None) -> NodeSummary:
    """What a node publishes of its capture: its ranks' heartbeats, their recent collectives
    from the Flight Recorder dumps just taken, the groups they are members of."""
    s = coord.summarize_heartbeats(raw_heartbeats(layout), node=node, host=host,
                                   moving=moving, alive=alive, kind="capture")
    for r in s.ranks:
        fr = layout.rank(r.rank).fr
        with contextlib.suppress(Exception):  # a dump cut short: the heartbeat is left
            if fr.exists():
                r.history, r.fr_status = history_of(frtrace.load(fr))
    groups: dict[str, set[int]] = {}
    for p in layout.files_of("groups.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for pg, rs in json.loads(p.read_text()).items():
                groups.setdefault(str(pg), set()).update(int(r) for r in rs)
    s.groups = {pg: sorted(rs) for pg, rs in groups.items()}
    return s


def _fr_of(r: RankSummary) -> FRDump | None:
    """What a remote rank's recorder said, back as a dump (the richest evidence there is of
    it): its recent collectives by group name, with the groups' status."""
    if not r.history and not r.fr_status:
        return None
    entries = []
    for h in r.history:
        frames = [Frame(str(file), int(line), str(fn))
                  for file, line, fn in (coord.parse_frame(f) for f in h.frames)]
        entries.append(Collective(
            pg=h.pg or h.pg_id, seq=h.seq, op=normalise_op(h.op), raw_op=h.op,
            pg_desc=h.pg_desc or "", input_sizes=h.input_sizes, output_sizes=h.output_sizes,
            dtypes=[normalise_dtype(d) for d in h.dtypes], time_created_ns=h.t_ns,
            frames=frames, completed=h.completed))
    status = {pg: PgStatus(v[0], v[1]) for pg, v in r.fr_status.items()}
    return FRDump(entries=entries, pg_status=status, backend="remote summary")


def merge_remote(ev: Evidence, summaries: Mapping[str, NodeSummary]) -> list[int]:
    """The ranks of other nodes, from their watchers' summaries, as evidence beside this
    node's own (a rank with evidence of its own is kept). Returns the ranks added."""
    added: list[int] = []
    for _node, s in sorted(summaries.items()):
        hbs = coord.to_heartbeats([s])
        for r in s.ranks:
            if r.rank in ev.ranks:
                continue
            hb = Heartbeat.parse(hbs[r.rank])
            if hb is not None and hb.pg_status is not None:
                # a group is named by id in a heartbeat; only its pending entries (and the
                # default group, id 0 = name 0) say which name: an id of unknown name could
                # read as another group of the same number on this node
                named = {str(e.get("pg_id")) for e in hb.pending} | {DEFAULT_PG}
                hb.pg_status = {k: v for k, v in hb.pg_status.items() if k in named}
            ev.ranks[r.rank] = RankEvidence(
                rank=r.rank, pid=r.pid, host=s.host, alive=r.state != "exited",
                exit_code=r.exit_code, heartbeat=hb, progressed=r.moving, fr=_fr_of(r),
                groups={k: list(v) for k, v in s.groups.items()} or None)
            added.append(r.rank)
    return sorted(added)


def _groups_of(ev: Evidence) -> dict[str, set[int]]:
    """Group name -> members, as far as known: the probes' group lists, and every rank that
    posted in a group (its recorder's entries or status)."""
    out: dict[str, set[int]] = {}
    for r in ev.ranks.values():
        for pg, ranks in (r.groups or {}).items():
            out.setdefault(pg, set()).update(ranks)
        if r.fr is not None:
            for pg in {*r.fr.pg_status, *(c.pg for c in r.fr.entries)}:
                out.setdefault(pg, set()).add(r.rank)
    return out


def _members(members: Mapping[str, set[int]], pg: str, world: int | None) -> set[int]:
    """A group's members as far as known; the default group has every rank."""
    return set(members.get(pg, set())) | (set(range(world)) if pg == DEFAULT_PG and world
                                          else set())


def rank_list(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + spans(rs)


def _where(ranks: Sequence[int], local_world: int | None, hosts: Mapping[str, str],
           most: int = 4) -> str:
    """"on node vm-1" (the host when known, else the node's number); many: the first few."""
    if not local_world:
        return "on other nodes"
    nodes = sorted({r // local_world for r in ranks})
    word = "on node " if len(nodes) == 1 else "on nodes "
    if not any(str(n) in hosts for n in nodes):
        return word + spans(nodes)
    names = [hosts.get(str(n)) or str(n) for n in nodes]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return word + ", ".join(names[:most]) + more


def guard_unknown(diag: Diagnosis, ev: Evidence, unknown: Sequence[int], *,
                  local_world: int | None, hosts: Mapping[str, str]) -> Diagnosis:
    """Known ranks are never blamed for waiting on unknown ones.

    A verdict stands when a group whose members are all known disagrees, or when a known
    rank crashed or died; otherwise the known ranks only wait, and for whom is the
    verdict: "ranks 0, 1 wait in all_reduce default_pg#3 for ranks 2, 3 on node vm-1". The
    unknown ranks are listed (state unknown) either way."""
    if not unknown:
        return diag
    known = set(ev.ranks)
    unknown_set = set(unknown)
    nodes = sorted({r // local_world for r in unknown}) if local_world else []
    diag.evidence.append(
        f"{rank_list(unknown)} unknown: no answer from the watcher "
        + (_where(unknown, local_world, hosts).replace("on ", "of ", 1) if nodes else
           "of their nodes"))
    have = {r.rank for r in diag.ranks}
    for r in sorted(unknown_set - have):
        node = str(r // local_world) if local_world else "?"
        diag.ranks.append(RankReport(rank=r, host=hosts.get(node), state=RankState.UNKNOWN,
                                     note=f"node {node}: no watcher answered"))
    diag.ranks.sort(key=lambda x: x.rank)
    if diag.verdict in NO_PROBLEM:
        return diag
    divs = [d for d in (diag.first_divergence, *diag.divergences) if d is not None]
    if any(d.members and set(d.members) <= known for d in divs):
        return diag  # a fully observed group disagrees: that is a fact whatever the rest does
    if (diag.culprit_basis in (CulpritBasis.EXCEPTION, CulpritBasis.EXITED)
            and diag.culprit_ranks and set(diag.culprit_ranks) <= known):
        return diag  # a known rank raised or died
    members = _groups_of(ev)
    world = ev.world_size
    waits: dict[tuple[str, str, int | None], list[int]] = {}
    labels: dict[tuple[str, str, int | None], str] = {}
    for rep in diag.ranks:
        c = rep.collective
        if rep.rank not in known or c is None or rep.state != RankState.IN_COLLECTIVE:
            continue
        group = _members(members, c.pg, world)
        if group and group <= known:
            return diag  # it waits for known ranks only: the verdict is about known ranks
        key = (c.op, c.pg, c.seq)
        waits.setdefault(key, []).append(rep.rank)
        seq = f"#{c.seq}" if c.seq is not None else ""
        labels[key] = f"{c.op} {pg_label(c.pg, c.pg_desc, word='pg')}{seq}"
    if not waits:
        return diag
    parts = []
    for key, rs in sorted(waits.items(), key=lambda kv: kv[1]):
        them = sorted(_members(members, key[1], world) & unknown_set) or sorted(unknown_set)
        verb = "waits" if len(rs) == 1 else "wait"
        parts.append(f"{rank_list(rs)} {verb} in {labels[key]} for {rank_list(them)} "
                     f"{_where(them, local_world, hosts)}")
    where = _where(sorted(unknown_set), local_world, hosts)
    text = "; ".join(parts) + ": run moe-hang there, or `moe-hang analyze` both captures"
    diag.verdict = Verdict.HANG
    diag.summary = text[:1].upper() + text[1:]
    diag.culprit_ranks = []
    diag.culprit_basis = CulpritBasis.NONE
    diag.certainty = Certainty.UNCERTAIN
    diag.rule = "waits_on_unknown_ranks"
    diag.fix = (f"Nothing here is to blame: the ranks wait for others whose watcher did not "
                f"answer. Run `moe-hang diagnose` {where} (or `moe-hang watch` there), "
                "then `moe-hang analyze` the captures together.")
    diag.fix_code = None
    return diag


def guard_local(diag: Diagnosis, layout: RunLayout, outcome: Outcome) -> Diagnosis:
    """A node's own diagnosis of a job that spans nodes (its ranks say WORLD_SIZE is more
    than they are): :func:`guard_unknown` over the ranks of the others. Unchanged on one
    node."""
    world = world_of(outcome.heartbeats)
    if not world or world <= len(outcome.heartbeats):
        return diag
    lw = next((hb.local_world for hb in outcome.heartbeats.values() if hb.local_world), None)
    ev = load_capture(layout.root, world=world)
    return guard_unknown(diag, ev, local_ranks_unknown(world, ev.ranks),
                         local_world=lw or len(outcome.heartbeats), hosts={})


def local_ranks_unknown(world: int | None, known: Iterable[int]) -> list[int]:
    return sorted(set(range(world)) - set(known)) if world else []


# ----------------------------------------------------------------------------- a verdict as data


def _frame(d: Any) -> Frame | None:
    if not isinstance(d, Mapping):
        return None
    try:
        return Frame(str(d["file"]), int(d.get("line") or 0), str(d.get("function", "?")))
    except (KeyError, TypeError, ValueError):
        return None


def _collective(d: Any) -> RankCollective | None:
    if not isinstance(d, Mapping):
        return None
    return RankCollective(
        op=str(d.get("op", "?")), pg=str(d.get("pg", "?")),
        seq=None if d.get("seq") is None else int(d["seq"]),
        input_sizes=[list(s) for s in d.get("input_sizes") or []],
        dtypes=[str(x) for x in d.get("dtypes") or []], source=str(d.get("source", "")),
        pg_desc=str(d.get("pg_desc", "")), tag=d.get("tag"), callsite=_frame(d.get("callsite")))


def _divergence(d: Any) -> Divergence | None:
    if not isinstance(d, Mapping):
        return None
    return Divergence(pg=str(d.get("pg", "?")),
                      seq=None if d.get("seq") is None else int(d["seq"]),
                      kind=MismatchKind(d.get("kind", MismatchKind.MISSING)),
                      pg_desc=str(d.get("pg_desc", "")),
                      members=[int(r) for r in d.get("ranks") or []],
                      per_rank={int(r): _collective(c)
                                for r, c in (d.get("per_rank") or {}).items()},
                      phase=d.get("phase"))


def _timeline(d: Any) -> Timeline | None:
    if not isinstance(d, Mapping):
        return None
    rows: dict[int, list[TimelineCell | None]] = {}
    for r, cells in (d.get("ranks") or {}).items():
        rows[int(r)] = [TimelineCell(str(c.get("op", "?")), [list(s) for s in c.get("sizes")
                                                              or []],
                                     str(c.get("state", "")), c.get("name"))
                        if isinstance(c, Mapping) else None for c in cells]
    return Timeline(pg=str(d.get("pg", "")), pg_desc=str(d.get("pg_desc", "")),
                    seqs=[int(s) for s in d.get("seqs") or []], highlight=d.get("highlight"),
                    ranks=rows)


def diagnosis_from_dict(d: Mapping[str, Any]) -> Diagnosis:
    """A diagnosis back from its JSON (``Diagnosis.to_dict``), for the nodes that print the
    verdict another node analysed: every node renders the very same object. The command's
    own record (``run``) is not read back; every node adds its own."""
    ranks = []
    for r in d.get("ranks") or []:
        ranks.append(RankReport(
            rank=int(r["rank"]), pid=r.get("pid"), host=r.get("host"),
            state=RankState(r.get("state", RankState.UNKNOWN)),
            collective=_collective(r.get("collective")), callsite=_frame(r.get("callsite")),
            tokens=r.get("tokens"), exit_code=r.get("exit_code"), phase=r.get("phase"),
            autograd_function=r.get("autograd_function"),
            stack=[str(s) for s in r.get("stack") or []], stack_source=r.get("stack_source"),
            note=r.get("note")))
    return Diagnosis(
        verdict=Verdict(d.get("verdict", Verdict.INCONCLUSIVE)), summary=str(d.get("summary", "")),
        culprit_ranks=[int(r) for r in d.get("culprit_ranks") or []],
        first_divergence=_divergence(d.get("first_divergence")), ranks=ranks,
        fix=str(d.get("fix", "")), artifacts=str(d.get("artifacts", "")),
        evidence=[str(e) for e in d.get("evidence") or []], timeline=_timeline(d.get("timeline")),
        culprit_basis=CulpritBasis(d.get("culprit_basis", CulpritBasis.NONE)),
        certainty=Certainty(d.get("certainty", Certainty.UNCERTAIN)),
        fix_code=d.get("fix_code"), rule=str(d.get("rule", "")),
        divergences=[x for x in (_divergence(v) for v in d.get("divergences") or [])
                     if x is not None])


# ----------------------------------------------------------------------------- watch: one node


def request_kind(req: CaptureRequest | None) -> str:
    """What the request was made for ("stalled: no progress ..." -> "stalled")."""
    if req is None:
        return "requested"
    kind, sep, _ = req.reason.partition(":")
    return kind if sep and kind in (*_JOB_OF, *ON_DEMAND) else "requested"


def _reason_text(req: CaptureRequest | None) -> str:
    return req.reason.partition(":")[2].strip() if req is not None else ""


@dataclass
class RoundOutcome:
    diagnosis: Diagnosis  # the one every node prints
    kind: str  # what the round was for (request_kind): decides whether the job is ended
    verdict: GlobalVerdict


class Node:
    """This watcher's part: a channel connected in the background, registration once the
    local ranks are up, summaries offered from the watch loop (no I/O there), and rounds."""

    def __init__(self, p: Plan, layout: RunLayout, notice: Callable[[str], None], *,
                 stall_s: float = 10.0) -> None:
        self.plan, self.layout, self.notice = p, layout, notice
        # "moving" in a summary: moved this recently (well inside --stall, so that ranks that
        # just entered the collective the others wait in are not read as computing)
        self.moving_s = min(MOVING_S, stall_s / 2)
        self.publish_s = 2.0
        self.host = socket.gethostname()
        self.co: Coordinator | None = None
        self.node = ""
        self.world: int | None = None
        self.local_world: int | None = None
        self.local_ranks: list[int] = []
        self.why_local: str | None = None  # why there is no channel
        self.verdict: GlobalVerdict | None = None  # of the last round
        self.job: LaunchedJob | None = None
        self._up = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_offer = 0.0
        self._snapshot: int | None = None  # job.log's size when the ranks were captured
        self._run_info: RunInfo | None = None  # this node's own record (command, timings)

    # ------------------------------------------------------------------ background

    def attach(self, job: LaunchedJob) -> None:
        """After the job started. torch (for the store client) is imported here, in the main
        thread, while the job starts up: never half-way in a daemon thread at exit."""
        self.job = job
        if self.plan.shared_dir is None:
            coord.preload_torch()
        self._thread = threading.Thread(target=self._run, name="moe-hang-multinode",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ch: Channel | None = None
        if self.plan.shared_dir is None:  # the store may appear after us: connect early
            ch, why = open_channel(self.plan, connect_s=CONNECT_S, stop=self._closed)
            if ch is None:
                self.why_local = why
                return
        while not self._up.wait(0.25):
            if self._closed.is_set():
                if ch is not None:
                    ch.close()
                return
        pids = [self.job.pid, *self.job.tracker.seen] if self.job is not None else []
        ep = self.plan.endpoint or _agent_endpoint(pids)
        if ch is None:
            if self.plan.endpoint is None and ep is not None:
                # the watched command wraps torchrun (ip netns exec, bash -c, a container):
                # the run id is the agent's, as diagnose will read it
                self.plan.run = coord.run_key(ep.run_id)
            ch, self.why_local = open_channel(self.plan, connect_s=0.0)
            if ch is None:
                return
        hosts = ep is not None and coord.store_listener_pid(ep.port, pids) is not None
        co = Coordinator(ch, self.node, self.host)
        co.register(self.local_ranks, hosts_store=hosts, world=self.world,
                    local_world=self.local_world)
        with self._lock:
            if self._closed.is_set():
                co.close()
                return
            self.publish_s = max(2.0, len(self.expected()) / 100)
            co.start(interval=1.0, publish_every_s=self.publish_s)
            self.co = co

    def expected(self) -> list[str]:
        return coord.expected_nodes(self.world, self.local_world)

    def _raw_heartbeats(self) -> dict[int, dict[str, Any]]:
        return raw_heartbeats(self.layout)

    def tick(self, mon: Monitor) -> bool:
        """Every poll of the watch loop: in memory only (the coordinator's thread does the
        I/O). True when a capture request is waiting (another node's, or a diagnose)."""
        out = mon.out
        if not self._up.is_set():
            if out.t_up is None:
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
            self.node = coord.node_id_from_heartbeats(hbs) or coord.sanitize(self.host)
            self._up.set()
        co = self.co
        if co is None:
            return False
        now = time.monotonic()
        if now - self._last_offer >= OFFER_S:
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
        every OFFER_S, the coordinator publishes a changed one at most every publish_s, on
        its next beat (1 s)."""
        return OFFER_S + self.publish_s + 1.0 + self.moving_s + 0.5

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
        if co is None:
            return
        if final is not None:
            hbs = self._raw_heartbeats()
            s = coord.summarize_heartbeats(hbs, node=self.node, host=self.host,
                                           alive=dict.fromkeys(hbs, False), kind="periodic")
            co.publish_summary(s)
        co.close()

    def next_round(self) -> None:
        if self.co is not None:
            self.co.next_round()

    # ------------------------------------------------------------------ a round

    def _capture_summary(self, mon: Monitor, outcome: Outcome) -> NodeSummary:
        alive = {r: is_alive(pid) for r, pid in outcome.rank_pids.items()}
        if outcome.kind in ("stalled", "desync"):
            moving = dict.fromkeys(alive, False)  # by construction nothing moved
        else:
            moving = {r: outcome.progressed[r] for r in outcome.progressed}
        return capture_summary(self.layout, self.node, self.host, moving=moving, alive=alive)

    def _snapshot_capture(self) -> None:
        """The ranks' files as captured: ending the job (here, or on another node first)
        makes the ranks raise, dump and log connection errors into the same directory, and
        ``analyze`` must read the capture the verdict came from (:meth:`finish`)."""
        snap = self.layout.root / SNAPSHOT_DIR
        shutil.rmtree(snap, ignore_errors=True)

        def not_plain(d: str, names: list[str]) -> list[str]:
            return [n for n in names if not (Path(d) / n).is_file()
                    and not (Path(d) / n).is_dir()]

        with contextlib.suppress(OSError, shutil.Error):
            shutil.copytree(self.layout.ranks_dir, snap / "ranks", ignore=not_plain)
            try:
                self._snapshot = self.layout.job_log.stat().st_size
            except OSError:
                self._snapshot = 0

    def _analyse(self, summaries: dict[str, NodeSummary], missing: list[str], kind: str,
                 req: CaptureRequest | None) -> dict[str, Any]:
        """On the node that analyses: its own capture plus every other node's summary."""
        ev = load_capture(self.layout.root, world=self.world, job=_JOB_OF.get(kind, "running"))
        merge_remote(ev, {n: s for n, s in summaries.items() if n != self.node})
        co = self.co
        hosts = {n: s.host for n, s in summaries.items()}
        if co is not None and (missing or (self.world and len(ev.ranks) < self.world)):
            for n, info in co.nodes().items():
                hosts.setdefault(n, info.host)
            # a node whose job finished said so before its watcher left: not unknown
            done = {n: s for n, s in co.read_summaries(missing).items()
                    if s.ranks and all(r.state == "exited" for r in s.ranks)}
            merge_remote(ev, done)
        if self.world:
            ev.world_size = self.world
        diag = diagnose(ev)
        (self.layout.root / COORD_DIR).mkdir(mode=0o700, exist_ok=True)
        rundir.write_json(self.layout.root / COORD_DIR / "analysis.json", diag.to_dict())
        guard_unknown(diag, ev, local_ranks_unknown(self.world, ev.ranks),
                      local_world=self.local_world, hosts=hosts)
        if kind == "final":
            text = _reason_text(req)
            diag.verdict = Verdict.HANG
            diag.summary = (text[:1].upper() + text[1:] + ". " if text else "") + diag.summary
        d = diag.to_dict()
        d["artifacts"] = ""  # every node's own run directory
        return d

    def run_round(self, mon: Monitor, outcome: Outcome, kind: str,
                  capture_local: Callable[[], Diagnosis]) -> RoundOutcome:
        """Capture here, the same on every node, one verdict; returns once this node may end
        its job (the store's host after every other node has the verdict)."""
        co = self.co
        req: CaptureRequest | None = None
        if co is not None:
            req = co.capture_requested() or co.request_capture(f"{kind}: {outcome.reason}")
        local_kind = kind

        def capture() -> NodeSummary:
            local = capture_local()
            self._run_info = local.run
            (self.layout.root / COORD_DIR).mkdir(mode=0o700, exist_ok=True)
            rundir.write_json(self.layout.root / COORD_DIR / "local-diagnosis.json",
                              local.to_dict())
            self._snapshot_capture()
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
                               unknown_ranks=local_ranks_unknown(self.world, self.local_ranks),
                               local_only=True, note=f"{why}: local ranks only",
                               _summaries={self.node: mine})
            self.notice(f"no other node reachable ({why}): a verdict from this node's ranks "
                        "only")
        else:
            rk = request_kind(req)
            if req.by_node != self.node:
                self.notice(f"capture requested by node {req.by_node} ({req.host}): "
                            f"{_reason_text(req)[:120]}")
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
        self.verdict = gv
        diag = diagnosis_from_dict(gv.verdict)
        diag.artifacts = str(self.layout.root)
        diag.run = self._run_info
        if isinstance(diag.run, WatchRun) and outcome.onset_ns:
            diag.run.timings.onset_to_verdict_s = round(time.time() - outcome.onset_ns / 1e9, 3)
        (self.layout.root / COORD_DIR).mkdir(mode=0o700, exist_ok=True)
        rundir.write_json(self.layout.root / COORD_DIR / "verdict.json", gv.to_json())
        return RoundOutcome(diag, local_kind, gv)

    def finish(self, ended_after_verdict: bool) -> None:
        """After the job ended: where a verdict ended it, the run directory keeps the capture
        it came from (ranks/, job.log up to then); what came after is in teardown/."""
        snap = self.layout.root / SNAPSHOT_DIR
        try:
            if not ended_after_verdict or self._snapshot is None or not (snap / "ranks").is_dir():
                return
            tear = self.layout.root / TEARDOWN_DIR
            tear.mkdir(mode=0o700, exist_ok=True)
            os.replace(self.layout.ranks_dir, tear / "ranks")
            os.replace(snap / "ranks", self.layout.ranks_dir)
            log = self.layout.job_log
            with open(log, "rb+") as f:
                f.seek(self._snapshot)
                rest = f.read()
                f.truncate(self._snapshot)
            (tear / "job.log").write_bytes(rest)
        except OSError as exc:
            self.notice(f"could not keep the capture apart from the teardown ({exc})")
        finally:
            shutil.rmtree(snap, ignore_errors=True)


def _agent_endpoint(pids: Iterable[int]) -> StoreEndpoint | None:
    """The store of the torchrun agent among the job's processes (the watched command may be
    a wrapper: ``ip netns exec ...``, ``bash -c ...``, a container runtime)."""
    import psutil

    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            p = psutil.Process(pid)
            ep = coord.endpoint_from_torchrun(p.cmdline(), {
                k: v for k, v in p.environ().items() if k.startswith("PET_")})
            if ep is not None:
                return ep
    return None


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


# ----------------------------------------------------------------------------- diagnose


def peers_for_diagnose(agent_cmdline: Sequence[str], agent_env: Mapping[str, str],
                       shared_dir: str | os.PathLike[str] | None, local_ranks: Iterable[int],
                       *, connect_s: float = 3.0) -> tuple[dict[str, NodeSummary], str | None]:
    """The other nodes' latest summaries, where their watchers publish them: (node ->
    summary, None) or ({}, why not). Only summaries younger than FRESH_S; never this node's
    own ranks."""
    p = plan(agent_cmdline, shared_dir, agent_env)
    if p is None:
        return {}, None
    if p.shared_dir is None:
        coord.preload_torch()
    ch, why = open_channel(p, connect_s=connect_s)
    if ch is None:
        return {}, why
    try:
        co = Coordinator(ch, f"diagnose-{socket.gethostname()}-{os.getpid()}")
        sums = co.read_summaries()
        if ch.gone:
            return {}, ch.gone
        mine = set(local_ranks)
        now = time.time()
        return {n: s for n, s in sums.items()
                if now - s.time <= FRESH_S and not mine & {r.rank for r in s.ranks}}, None
    finally:
        ch.close()
