"""What the evidence establishes about a job, computed once and read by every rule (pure)."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from moe_hang.analysis.activity import Judgement, Motion, judge
from moe_hang.analysis.align import GroupDivergence, divergences, settle
from moe_hang.analysis.culprit import Blame, blame
from moe_hang.analysis.departed import answered_all, as_departed, departing
from moe_hang.analysis.diagnosis import (
    CulpritBasis,
    Divergence,
    MismatchKind,
    RankReport,
)
from moe_hang.analysis.fallback import stack_divergence
from moe_hang.analysis.ladder import Context
from moe_hang.analysis.peer_done import done_by_peers
from moe_hang.analysis.position import position_order, progress
from moe_hang.analysis.program import Program, learn
from moe_hang.analysis.ranks import report
from moe_hang.analysis.rankstate import rank_view
from moe_hang.analysis.ras.reading import RasReading, read_ras
from moe_hang.analysis.reconcile import Disagreement, reconcile
from moe_hang.analysis.situation import Situation
from moe_hang.analysis.size_abort import size_abort_divergence
from moe_hang.analysis.threads import ThreadRace, thread_race
from moe_hang.analysis.timeline import RankView, RankViews
from moe_hang.analysis.waitfor import Edge, cycles, edges
from moe_hang.evidence.errors import is_consequence, is_mismatch_report
from moe_hang.evidence.model import Evidence, RankError, RankEvidence
from moe_hang.evidence.probe_records import said_exiting
from moe_hang.evidence.stacks import Helper, callsite, is_library_frame
from moe_hang.evidence.vocab import JobState, RankState

# Killed from outside: the OOM killer, an operator, a node agent (SIGTERM is torchrun's own
# teardown, SIGABRT gloo's or a C++ abort: read elsewhere)
_KILL_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                 signal.SIGQUIT, signal.SIGHUP}


@dataclass
class Facts:
    ev: Evidence
    views: RankViews
    divs: list[GroupDivergence]  # every group's first divergence, earliest first
    blames: list[Blame]  # one per divergence
    wait_edges: list[Edge]
    wait_cycles: list[list[Edge]]
    root_causes: dict[int, RankError]  # exceptions that are not a consequence of a peer
    consequences: dict[int, RankError]
    mismatch_reports: dict[int, RankError]  # a collective's own check failed: a desync
    killed: list[int]  # by a signal from outside, or gone without a trace
    left: list[int]  # exited cleanly while others still wait
    bad_exit: list[int]  # exited with an error, a signal, or an exception on record
    exited: list[int]
    alive: list[int]
    moving: list[int]
    waiting: list[int]  # alive, in a collective or idle, not moving
    agent_died: bool
    orphans_moving: bool
    stack_div: tuple[Divergence, list[int], CulpritBasis] | None = None  # from stacks alone
    size_abort: tuple[Divergence, list[int]] | None = None  # and the ranks gloo aborted
    evidence: list[str] = field(default_factory=list)
    # its program ended after posting every collective the others wait in (they are only
    # slower out of the last ones): gone, or still in its interpreter's exit
    finishing: list[int] = field(default_factory=list)
    # a rank whose own count, stack and peers' records could not be made to agree
    disagreements: list[Disagreement] = field(default_factory=list)
    # what the counters say of each live rank that sat in a collective (analysis.activity)
    activity: dict[int, Judgement] = field(default_factory=dict)
    # the program the ranks agreed on, learned from the steps before every divergence
    program: Program = field(default_factory=Program)
    ras: RasReading | None = None  # what NCCL RAS's reports say together (None: none read)
    # the first divergence two threads' interleaving on one group explains (threads.py)
    thread_race: ThreadRace | None = None
    _fixed_reports: dict[int, RankReport] = field(default_factory=dict, repr=False)

    @property
    def ctx(self) -> Context:
        return Context(self.views, self.program)

    def reports(self, div: Divergence | None) -> dict[int, RankReport]:
        """Every rank's report, showing its side of ``div`` — which only a rank with nothing
        pending shows: one with a collective pending reports it whatever ``div`` (made once;
        at 8192 ranks the rules ask three times)."""
        fixed = self._fixed_reports
        return {r: (fixed.get(r) or fixed.setdefault(r, report(v, None)))
                if v.current is not None else report(v, div) for r, v in self.views.items()}

    def causal(self) -> list[tuple[GroupDivergence, Blame]]:
        """Divergences that are a cause, not the consequence of another group's."""
        return [(g, b) for g, b in zip(self.divs, self.blames, strict=True) if b.causal]


def _evidence_lines(ev: Evidence) -> list[str]:
    lines = list(ev.log_lines)
    for r, e in sorted(ev.ranks.items()):
        if e.fr_error:
            lines.append(f"rank {r}: Flight Recorder dump unreadable ({e.fr_error})")
        if e.stack_error:
            lines.append(f"rank {r}: {e.stack_error}")
        lines.extend(f"rank {r}: {n}" for n in e.notes)
    return lines


def _consequences(divs: list[GroupDivergence], blames: list[Blame],
                  views: RankViews) -> list[Blame]:
    """A member missing from one group's collective because it is held up in another's is a
    consequence there, not a second culprit: held in a mismatched one (posted by every
    member, different op/size/dtype: it can never complete), or behind — waiting in another
    group's collective that a member present at the divergence has completed (posted first
    and got past: a tree broadcast lets its root's direct children go on while the others
    wait for a rank that never came, a rank idle on a lock)."""
    never = {(g.div.pg, g.div.seq) for g in divs if g.div.kind != MismatchKind.MISSING}
    # where another divergence's ranks were read as the ones that deviated: the others
    # there wait for them (or waited, until a timeout ended them)
    owed = {(g.div.pg, g.div.seq): set(b.culprits) for g, b in zip(divs, blames, strict=True)
            if b.causal and b.basis != CulpritBasis.AMBIGUOUS and b.culprits}

    def held_up(a: int, present: Iterable[int]) -> bool:
        c = views[a].current
        # in a collective, or ended (a timeout raised) in one it never completed
        if c is None or views[a].state not in (RankState.IN_COLLECTIVE, RankState.EXITED) \
                or (views[a].state == RankState.EXITED and c.completed is not False):
            return False
        # waiting in that collective, or a later one of the same group: past a divergence
        # its group's collectives pair up wrongly (gloo pairs equal sizes silently), and
        # every later one waits on the ranks that deviated there
        if any(pg == c.pg and seq is not None and c.seq is not None and c.seq >= seq
               and a not in who for (pg, seq), who in owed.items()):
            return True
        return (c.pg, c.seq) in never or (c.completed is False and any(
            p in views and views[p].tl.completed.get(c.pg, -1) >= c.seq for p in present))

    return [replace(b, causal=False)
            if g.div.kind == MismatchKind.MISSING and g.absent and b.causal
            and all(held_up(a, g.have) for a in g.absent) else b
            for g, b in zip(divs, blames, strict=True)]


def facts(ev: Evidence) -> Facts:
    views = RankViews(((r, rank_view(e, ev.source)) for r, e in sorted(ev.ranks.items())),
                      ev.source)
    for r, done in done_by_peers(views).items():  # what its peers saw complete, it ran too
        views[r] = rank_view(ev.ranks[r], ev.source, done)
    for r in departing(views):  # gone, whatever its last recorder said: what it posted decides
        views[r] = as_departed(views[r])
    disagreements = reconcile(views, ev.size_abort)
    doubts: dict[str, int] = {}
    divs = divergences(views, ev.world_size, doubts)
    size_abort = size_abort_divergence(views, ev) if ev.size_abort is not None else None
    bounds: dict[str, int | None] = dict(doubts)
    for g in divs:
        if g.div.seq is not None:
            b = bounds.get(g.div.pg)
            bounds[g.div.pg] = g.div.seq if b is None else min(b, g.div.seq)
    if size_abort is not None and size_abort[0].seq is not None:  # where the pairing broke
        pg, seq = size_abort[0].pg, size_abort[0].seq
        bounds[pg] = min(seq, b) if (b := bounds.get(pg)) is not None else seq
    program = learn(views, bounds)
    ctx = Context(views, program)
    found = [blame(g, ctx) for g in divs]
    for g in divs:
        settle(g)
    blames = _consequences(divs, found, views)
    es = edges(views, divs)
    act = _activity(views)
    counted = {r for r, j in act.items() if j.motion == Motion.MOVING}
    cyc = [c for c in cycles(es)
           if all(views[e.waiter].ev.progressed is False and e.waiter not in counted
                  for e in c)]
    root: dict[int, RankError] = {}
    conseq: dict[int, RankError] = {}
    mismatch: dict[int, RankError] = {}
    for r, e in ev.ranks.items():
        if e.error is None:
            continue
        if is_mismatch_report(e.error):
            mismatch[r] = e.error
        else:
            (conseq if is_consequence(e.error) else root)[r] = e.error
    exited = [r for r, v in views.items() if v.state == RankState.EXITED]
    # exit 0, or gone while the launcher lives on (no exit code yet) after the probe's last
    # beat said the interpreter was shutting down normally
    # (torchrun's SIGTERM may catch a rank already on its way out: still a clean exit)
    clean = [r for r in exited if not ev.ranks[r].error and not ev.ranks[r].fatal and (
        ev.ranks[r].exit_code == 0
        or (ev.ranks[r].exit_code in (None, -signal.SIGTERM)
            and said_exiting(ev.ranks[r].heartbeat)))]
    bad_exit = [r for r in exited if r not in clean]
    alive = [r for r in views if r not in exited]
    moving = [r for r in alive if views[r].ev.progressed or r in counted or views[r].moved
              or (views[r].state == RankState.COMPUTING and views[r].ev.progressed is not False)
              or (views[r].state != RankState.IN_COLLECTIVE
                  and working_helper(views[r]) is not None)]
    waiting = [r for r in alive if views[r].state in (RankState.IN_COLLECTIVE, RankState.IDLE)
               and r not in moving]
    killed = [r for r in bad_exit if r not in root and (
        ((code := ev.ranks[r].exit_code) is not None and code < 0 and -code in _KILL_SIGNALS)
        or (code is None and not ev.ranks[r].error and not ev.ranks[r].fatal))]
    # finished while another rank still waits — or failed waiting for it (gloo closes the
    # connection of a rank that leaves: its peer then dies of "Connection closed by peer")
    # (not one that had posted all they wait in: they are only slower out of the last ones)
    answered = answered_all(views, clean)
    left = [r for r in clean if r not in answered] if waiting or bad_exit else []
    finishing = [r for r in clean if waiting and r in answered]
    agent_died = ev.agent_exit_code is not None and ev.agent_exit_code < 0 and bool(alive)
    orphans_moving = agent_died and any(views[r].ev.progressed for r in alive)
    f = Facts(ev, views, divs, blames, es, cyc, root, conseq, mismatch, killed, left, bad_exit,
              exited,
              alive, moving, waiting, agent_died, orphans_moving,
              evidence=_evidence_lines(ev) + [d.text for d in disagreements],
              disagreements=disagreements, activity={r: j for r, j in act.items() if r in alive},
              finishing=finishing, program=program,
              ras=read_ras(ev.ras) if ev.ras is not None else None)
    f.evidence.extend(f"rank {r}: in a collective in every sample; {j.numbers}: "
                      f"{str(j.motion).replace('_', ' ')} ({j.why})"
                      for r, j in sorted(f.activity.items()))
    if not divs and len(waiting) >= 2:
        f.stack_div = stack_divergence(ctx, waiting, [r for r in alive if r not in waiting])
    f.size_abort = size_abort
    f.thread_race = thread_race(divs, views)
    return f


def desync_divs(f: Facts) -> list[tuple[GroupDivergence, Blame]]:
    """The causal divergences that are a desync: ranks posted different collectives at one
    seq, or a member skipped one and is now in another collective (outside any collective,
    idle or busy, a rank may just be slow: not a desync)."""
    out = []
    for g, b in f.causal():
        stuck_in_collectives = all(
            f.views[a].state in (RankState.IN_COLLECTIVE, RankState.EXITED) for a in g.absent)
        if g.div.kind != MismatchKind.MISSING or g.identity or stuck_in_collectives:
            out.append((g, b))
    return out


# ----------------------------------------------------------------------------- counters
# (docs/DESIGN.md §9: what a rank's process did while it sat in a collective)


def _backend(ev: RankEvidence) -> str | None:
    """The rank's process-group backend where its recorder or heartbeat names it."""
    if ev.fr is not None and ev.fr.backend:
        return str(ev.fr.backend)
    return ev.heartbeat.backend if ev.heartbeat is not None else None


def _activity(views: RankViews) -> dict[int, Judgement]:
    """What the counters say of each rank that sat in a collective while sampled."""
    out = {}
    for r, v in views.items():
        if v.state == RankState.IN_COLLECTIVE and v.ev.alive is not False and \
                (j := judge(v.ev.activity, _backend(v.ev))) is not None:
            out[r] = j
    return out


def stuck_shown(f: Facts) -> bool:
    """Something shows that the waiting ranks do not move, beyond their stacks: torch's
    watchdog timed out; a watcher saw their heartbeats (the recorder's sequence numbers) hold
    still for --stall s (not one that sampled them for want of its probe); or every one's
    counters say stuck."""
    if f.ev.job == JobState.TIMED_OUT:
        return True
    if f.ev.job in (JobState.STALLED, JobState.DESYNC) and not f.ev.sampled:
        return True
    return bool(f.waiting) and all(
        (j := f.activity.get(r)) is not None and j.motion == Motion.STUCK for r in f.waiting)


def working_helper(v: RankView) -> Helper | None:
    """A rank's own child process (a DataLoader worker) on CPU at the job's own code when
    sampled: work in progress the rank waits on — on a loaded machine its CPU time over a
    short window may say too little of it (a helper off CPU there is the one it waits on,
    stuck: waiting._stuck_helper)."""
    return next((h for h in v.ev.helpers if h.busy is True and h.site is not None), None)


def situation(f: Facts, div: Divergence, culprits: list[int],
              basis: CulpritBasis) -> Situation:
    """What advice is given from, for one divergence and its culprits."""
    frames = {}
    for r, v in f.views.items():
        coll = v.tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
        frames[r] = (coll.frames if coll is not None and coll.frames else v.stack.frames)
        if coll is not None and coll.frames and v.stack.frames \
                and not any(is_library_frame(x) for x in coll.frames) \
                and v.stack.callsite == callsite(coll.frames):
            # a node's summary and the posted log keep a collective's user frames only; its
            # stack, inside that same call, says how it was posted (FSDP's unshard, ...)
            frames[r] = v.stack.frames
    block = next((g.block for g in f.divs if g.div is div), None)
    s = Situation(div, culprits, basis, f.reports(div), frames, block, f.views.source)
    for c in div.per_rank:  # where each rank posted last on the group before it parted
        prev = f.views[c].tl.by_pg.get(div.pg, {}).get(div.seq - 1) \
            if c in f.views and div.seq is not None else None
        if prev is not None and prev.frames:
            s.before[c] = prev.frames
        if prev is not None and prev.time_created_ns is not None:
            s.before_ns[c] = prev.time_created_ns
        if c in f.views:
            v = f.views[c]
            s.enqueued[c] = v.tl.enqueued
            s.posted_ns[c] = {pg: t for pg, n in v.tl.enqueued.items()
                              if (e := v.tl.by_pg.get(pg, {}).get(n)) is not None
                              and (t := e.time_created_ns) is not None}
            s.counters[c] = {k: n for cs in v.stack.counters.values() for k, n in cs.items()}
    if basis == CulpritBasis.MAJORITY and s.lacks_fsdp_unshard():
        # asked only where the advice uses it (a culprit short of the others' FSDP call): on
        # thousands of ranks it is a position order per culprit and waiting rank
        waiting = s.waiting()
        s.behind = bool(culprits and waiting) and all(
            position_order(f.views.source, f.views[c].user_frames_outer_first(),
                           f.views[w].user_frames_outer_first(), progress(f.views, [c]),
                           progress(f.views, [w])) is False
            for c in culprits for w in waiting if c in f.views and w in f.views)
    return s
