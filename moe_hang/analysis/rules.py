"""From evidence to a verdict: the ordered rules (pure: no torch, no rich, no processes).

The core question is the one NCCL never answers: did every rank post the same collectives in
the same order with the same sizes? :mod:`~moe_hang.analysis.align` answers it per process
group; stacks say what each rank is doing now; exit codes and error records say who died.
:func:`facts` establishes all of that once; then the first rule of :data:`RULES` whose
condition holds names the verdict, the culprits and the sentence (docs/DESIGN.md §8).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_hang.analysis.align import align
from moe_hang.analysis.diagnosis import (
    Diagnosis,
    Divergence,
    RankReport,
    RankState,
    Verdict,
)
from moe_hang.analysis.explain import (
    desync_summary,
    exit_desc,
    fix_hint,
    fmt_sizes,
    ranks_text,
    site_str,
)
from moe_hang.analysis.fallback import size_abort_divergence, stack_divergence
from moe_hang.analysis.ranks import report
from moe_hang.analysis.timeline import RankView, build_timeline, rank_view
from moe_hang.evidence.model import Evidence, said_exiting


@dataclass
class Facts:
    """What the evidence establishes, computed once and read by every rule."""

    ev: Evidence
    views: dict[int, RankView]
    div: Divergence | None
    culprits: list[int]
    exited: list[int]
    bad_exit: list[int]  # exited with an error, a signal, or an exception on record
    killed: list[int]  # SIGKILLed, or gone without a trace
    alive: list[int]
    moving: list[int]
    waiting: list[int]  # alive, in a collective or idle, not moving
    reports: dict[int, RankReport]
    agent_died: bool
    orphans_moving: bool
    from_stacks: bool = False  # the divergence was read from stacks alone
    abort_detail: str = ""
    evidence: list[str] = field(default_factory=list)

    def waits(self) -> str:
        """``rank 0 in all_reduce(8), rank 2 in barrier``: the ranks left waiting."""
        victims = [r for r in self.views if r not in self.killed
                   and self.reports[r].collective is not None
                   and (r in self.waiting or self.reports[r].state == RankState.EXITED)]
        return ", ".join(f"rank {r} in {fmt_sizes(self.reports[r].collective)}"
                         for r in victims)


def _evidence_lines(ev: Evidence) -> list[str]:
    lines = list(ev.log_lines)
    for r, e in sorted(ev.ranks.items()):
        if e.fr_error:
            lines.append(f"rank {r}: Flight Recorder dump unreadable ({e.fr_error})")
        if e.stack_error:
            lines.append(f"rank {r}: {e.stack_error}")
        lines.extend(f"rank {r}: {n}" for n in e.notes)
    return lines


def facts(ev: Evidence) -> Facts:
    views = {r: rank_view(e) for r, e in sorted(ev.ranks.items())}
    found = align(views, ev.world_size)
    div = found.div if found else None
    culprits: list[int] = found.culprits if found else []
    exited = [r for r, v in views.items() if v.state == RankState.EXITED]
    bad_exit = [r for r in exited if ev.ranks[r].exit_code != 0 or ev.ranks[r].error]
    killed = [r for r in bad_exit if ev.ranks[r].exit_code == -signal.SIGKILL
              or (ev.ranks[r].exit_code is None and not ev.ranks[r].error
                  and not ev.ranks[r].fatal)]
    alive = [r for r in views if r not in exited]
    moving = [r for r in alive if views[r].ev.progressed
              or (views[r].state == RankState.COMPUTING and views[r].ev.progressed is not False)]
    waiting = [r for r in alive if views[r].state in (RankState.IN_COLLECTIVE, RankState.IDLE)
               and r not in moving]
    from_stacks = False
    abort_detail = ""
    if div is None and len(waiting) >= 2 and (sd := stack_divergence(views, waiting)):
        div, culprits = sd
        from_stacks = True
    if div is None and (size_abort := size_abort_divergence(views, ev)) is not None:
        div, culprits, abort_detail = size_abort
    agent_died = ev.agent_exit_code is not None and ev.agent_exit_code < 0 and bool(alive)
    orphans_moving = agent_died and any(views[r].ev.progressed for r in alive)
    if div is not None and agent_died and (
            orphans_moving
            or not all(views[r].state == RankState.IN_COLLECTIVE for r in alive)):
        # orphans still stepping when captured: a snapshot of ranks in flight (one already in
        # the next collective) is not a desync
        div, culprits, from_stacks, abort_detail = None, [], False, ""
    reports = {r: report(v, div) for r, v in views.items()}
    return Facts(ev, views, div, culprits, exited, bad_exit, killed, alive, moving, waiting,
                 reports, agent_died, orphans_moving, from_stacks, abort_detail,
                 _evidence_lines(ev))


@dataclass
class Outcome:
    verdict: Verdict
    culprits: list[int]
    summary: str


@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[Facts], bool]
    then: Callable[[Facts], Outcome]


def _desync(f: Facts) -> Outcome:
    assert f.div is not None
    exits = {r: f.ev.ranks[r].exit_code for r in f.bad_exit}
    summary = desync_summary(f.div, f.reports, f.culprits, exits)
    if f.abort_detail:
        summary = summary.rstrip(".") + f" ({f.abort_detail})."
    if f.from_stacks:
        summary += (" (from stacks alone: Flight Recorder dumps, e.g. by running under "
                    "`moe-hang watch`, would name the group and sequence number)")
    return Outcome(Verdict.DESYNC, f.culprits, summary)


def _agent_died(f: Facts) -> Outcome:
    w = f.waits()
    summary = (f"The launcher (torchrun agent) was {exit_desc(f.ev.agent_exit_code)}; rank "
               f"{ranks_text(f.alive)} were left orphaned"
               + (" and still running" if f.orphans_moving else "")
               + (f" ({'when captured' if f.orphans_moving else 'blocked'}: {w})" if w else "")
               + ". moe-hang ended them.")
    return Outcome(Verdict.CRASH, [], summary)


def _rank_died(f: Facts) -> Outcome:
    w = f.waits()
    dead = f.ev.ranks[f.killed[0]]
    if said_exiting(dead.heartbeat):  # its interpreter shut down: it left, not killed
        how = "exited (its interpreter shut down normally) before the others"
    elif dead.exit_code is None:
        how = "is gone (no process) mid-step"
    else:
        how = f"died ({exit_desc(dead.exit_code)}) mid-step"
    return Outcome(Verdict.RANK_DIED, f.killed, f"Rank {ranks_text(f.killed)} {how}"
                   + (f" while {w} waited for it." if w else "."))


def _crash(f: Facts) -> Outcome:
    ranks = f.ev.ranks
    culprits = [r for r in f.bad_exit if ranks[r].error or ranks[r].fatal]
    if not culprits and f.ev.root_cause_rank in f.bad_exit:
        culprits = [f.ev.root_cause_rank]
    if not culprits:  # the ranks torchrun ended with SIGTERM are the victims
        culprits = [r for r in f.bad_exit if ranks[r].exit_code != -signal.SIGTERM] \
            or f.bad_exit
    first = culprits[0]
    what = f.reports[first].note or exit_desc(ranks[first].exit_code)
    return Outcome(Verdict.CRASH, culprits, f"Rank {ranks_text(culprits)} crashed: {what}.")


def _finished(f: Facts) -> Outcome:
    return Outcome(Verdict.HEALTHY, [],
                   f"All {len(f.views)} ranks finished; every collective matched.")


def _all_moving(f: Facts) -> Outcome:
    return Outcome(Verdict.HEALTHY, [],
                   f"All {len(f.alive)} ranks are making progress (their stacks moved between "
                   "two samples): no hang right now.")


def _straggler(f: Facts) -> Outcome:
    culprits = sorted(f.moving)
    return Outcome(Verdict.STRAGGLER, culprits,
                   f"Rank {ranks_text(culprits)} is still computing while rank "
                   f"{ranks_text(f.waiting)} wait in a collective: slow, not deadlocked.")


def _outside(f: Facts) -> list[int]:
    """Waiting ranks that are not inside a collective (idle in a sleep, a lock, a read)."""
    return sorted(r for r in f.waiting if f.views[r].state != RankState.IN_COLLECTIVE)


def _blocked_outside(f: Facts) -> Outcome:
    culprits = _outside(f)
    where = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    return Outcome(Verdict.HANG, culprits,
                   f"Rank {ranks_text(culprits)} is blocked outside any collective ({where}) "
                   f"while {f.waits()} waits for it.")


def _all_in_one(f: Facts) -> Outcome:
    ops = {c.op if (c := f.reports[r].collective) else (f.views[r].stack.op or "?")
           for r in f.waiting}
    op = ops.pop() if len(ops) == 1 else "collectives"
    return Outcome(Verdict.HANG, [],
                   f"All {len(f.waiting)} ranks wait in {op} with matching order and sizes: "
                   "the collective order is consistent, so the cause is outside it.")


def _inconclusive(f: Facts) -> Outcome:
    known = [r for r, v in f.views.items() if v.state != RankState.UNKNOWN]
    return Outcome(Verdict.INCONCLUSIVE, [],
                   "Not enough evidence to name a cause: "
                   + (f"states known for rank {ranks_text(known)} only." if known
                      else "no stack or recorder data could be read."))


# First match wins.
RULES: tuple[Rule, ...] = (
    Rule("collective desync", lambda f: f.div is not None, _desync),
    Rule("launcher died", lambda f: f.agent_died, _agent_died),
    Rule("rank killed or gone", lambda f: bool(f.killed), _rank_died),
    Rule("rank crashed", lambda f: bool(f.bad_exit), _crash),
    Rule("every rank finished",
         lambda f: f.ev.job == "completed" or (bool(f.exited) and not f.alive), _finished),
    Rule("every rank moving", lambda f: bool(f.alive) and len(f.moving) == len(f.alive),
         _all_moving),
    Rule("straggler", lambda f: bool(f.waiting) and bool(f.moving), _straggler),
    Rule("blocked outside collectives",
         lambda f: bool(_outside(f)) and len(_outside(f)) < len(f.waiting), _blocked_outside),
    Rule("all wait in matching collectives",
         lambda f: bool(f.waiting) and len(f.waiting) == len(f.alive), _all_in_one),
    Rule("inconclusive", lambda f: True, _inconclusive),
)


def diagnose(ev: Evidence) -> Diagnosis:
    f = facts(ev)
    out = next(rule.then(f) for rule in RULES if rule.when(f))
    return Diagnosis(
        verdict=out.verdict, summary=out.summary, culprit_ranks=sorted(out.culprits),
        first_divergence=f.div, ranks=list(f.reports.values()),
        fix=fix_hint(f.div, f.reports, out.verdict), artifacts=ev.artifacts,
        evidence=f.evidence, timeline=build_timeline(f.views, f.div))
