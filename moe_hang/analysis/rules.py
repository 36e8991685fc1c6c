"""From evidence to a verdict: the ordered rules (pure: no torch, no rich, no processes).

:func:`~moe_hang.analysis.facts.facts` establishes once what the evidence says — every group's
divergence and who is to blame for it, the wait-for graph and its cycles, who raised what, who
died or left, who moves. Then the first rule of :data:`RULES` whose condition holds names the
verdict, the culprits (with the basis they follow from), how certain it is, the sentence and
the advice (docs/DESIGN.md §8). The README shows this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_hang.analysis.advice import (
    KIND_ADVICE,
)
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.culprit import blame_abort, mark_skipped
from moe_hang.analysis.cycles import cycle, thread_order
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Diagnosis,
    MismatchKind,
    Verdict,
)
from moe_hang.analysis.dumps_only import all_completed, nothing_pending
from moe_hang.analysis.explain import (
    abort_detail,
    block_summary,
    culprit_clause,
    desync_summary,
    waited_text,
)
from moe_hang.analysis.facts import Facts, desync_divs, facts, situation, stuck_shown
from moe_hang.analysis.failures import (
    agent_died,
    barrier_laggards,
    consequences_only,
    killed,
    left_early,
    monitored_barrier,
    outside_when_failed,
    restarted,
    root_cause,
    timed_out_waiting,
)
from moe_hang.analysis.joining import all_joining, stuck_joining
from moe_hang.analysis.p2p import advise_p2p, unmatched, unmatched_outcome
from moe_hang.analysis.paired import shift_divergence
from moe_hang.analysis.passes import stayed
from moe_hang.analysis.position import pass_on
from moe_hang.analysis.ras.failures import gone, nccl_errors, ras_rank_died, ras_rank_error
from moe_hang.analysis.ras.launches import (
    counts_differ,
    frozen_mismatch,
    ras_all_moving,
    ras_desync,
    ras_moving,
    ras_nothing_wrong,
    ras_one_poll_clean,
    ras_one_poll_mismatch,
)
from moe_hang.analysis.ras.reading import ras_summary
from moe_hang.analysis.roots import root_camps, roots_differ
from moe_hang.analysis.routing import routing_report
from moe_hang.analysis.shift import count_advice, shifted
from moe_hang.analysis.source import on_default_group
from moe_hang.analysis.timeline import build_timeline
from moe_hang.analysis.transport import transport, transport_hang
from moe_hang.analysis.unreached import (
    failed_elsewhere,
    failed_with_unknowns,
    unreached_line,
    unreached_reports,
    waiting_on_unreached,
    waits_on_unreached,
)
from moe_hang.analysis.waiting import (
    all_in_one,
    all_moving,
    finishing,
    in_one,
    inconclusive,
    progress_unseen,
    some_outside,
    stalled_outside,
    straggler,
)
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.vocab import JobState, RankState, agree, who


@dataclass(frozen=True)
class Rule:
    """One row of the table: a stable ``id`` (the JSON's ``rule_id``: scripts and tests key
    on it; never renamed), the ``name`` a person reads, when it fires and what it concludes,
    and — for the tables in the README and docs/DESIGN.md, generated from this one
    (scripts/rule_table.py) — the verdict, culprit basis and certainty it gives."""

    id: str
    name: str
    when: Callable[[Facts], bool]
    then: Callable[[Facts], Conclusion]
    verdict: str
    basis: str
    certainty: str


# ---------------------------------------------------------------------------- the rules


def _finished(f: Facts) -> Conclusion:
    n = len(f.views)  # a node of a multi-node job may run one rank
    every = f"All {n} ranks" if n != 1 else f"Rank {next(iter(f.views))}"
    if f.ev.restarts is not None:  # torchrun restarted the ranks: what the failed attempt did
        text, advice = restarted(f.ev.restarts)
        return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.DEFINITE,
                          f"{every} finished {text}.", advice)
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.DEFINITE,
                      f"{every} finished; every collective matched.")


def _size_abort(f: Facts) -> Conclusion:
    """gloo aborted a rank for a size mismatch: the recorder's alignment says where and who,
    when the survivors' records reach it (the aborted rank placed by its byte counts before
    any reading is made); else the abort itself does. One decision either way: the ladder's."""
    assert f.size_abort is not None
    div, aborted = f.size_abort
    detail = abort_detail(aborted, f.ev.size_abort)
    if found := desync_divs(f):
        out = _desync(f)
        # counts at a line say who posted more, not what: likely, and their sentence stays
        by_counts = found[0][1].shift is not None
        confirmed = not by_counts
        if not by_counts and out.div is not None and (
                _one_more_pass(f, out) or mark_skipped(out.div, out.culprits, f.ctx)):
            out.summary = desync_summary(out.div, f.reports(out.div), out.culprits, {}) \
                + culprit_clause(out.basis, out.culprits, confirmed)
        out.summary = out.summary.rstrip(".") + f" ({detail})."
        # the mismatch is certain; a culprit read off one side's history alone is likely
        out.certainty = Certainty.DEFINITE if confirmed else Certainty.LIKELY
        return out
    b = blame_abort(div, f.ctx, f.ev.size_abort, aborted)
    mark_skipped(div, b.culprits, f.ctx)
    reports = f.reports(div)
    exits = {r: f.ev.ranks[r].exit_code for r in f.bad_exit}
    summary = desync_summary(div, reports, b.culprits, exits).rstrip(".") + f" ({detail})."
    summary += culprit_clause(b.basis, b.culprits, b.confirmed)
    certainty = Certainty.DEFINITE if b.confirmed else Certainty.LIKELY
    return Conclusion(Verdict.DESYNC, b.culprits, b.basis, certainty, summary,
                      KIND_ADVICE[div.kind](situation(f, div, b.culprits, b.basis)), div)


def _one_more_pass(f: Facts, out: Conclusion) -> bool:
    """The culprits are still in a loop the others left, at a line every pass posts from:
    their collective at the divergence is that line's, one more pass — posted, not skipped
    to. Where the abort's sizes are the two sides' own, the mismatch is one of sizes."""
    div = out.div
    if div is None or stayed(situation(f, div, out.culprits, out.basis)) is None:
        return False
    posted = list(div.per_rank.values())
    if all(c is not None for c in posted) and len({c.op for c in posted if c}) == 1 \
            and len({repr(c.input_sizes) for c in posted if c}) > 1:
        div.kind = MismatchKind.SIZE
    return True


def _desync(f: Facts) -> Conclusion:
    found = desync_divs(f)
    g, b = found[0]
    culprits = sorted({r for _, bb in found for r in bb.culprits})
    reports = f.reports(g.div)
    exits = {r: f.ev.ranks[r].exit_code for r in f.bad_exit}
    if g.block is not None:  # and where it sits in a run of alike ones, the counts say
        summary = block_summary(g, reports) + (shifted(b.shift, f.views)[1] if b.shift else "")
    else:
        summary = desync_summary(g.div, reports, b.culprits, exits)
        summary += culprit_clause(b.basis, b.culprits, b.confirmed) if b.shift is None \
            else shifted(b.shift, f.views)[1]
    if len(found) > 1:
        summary += (f" {len(found) - 1} more group(s) diverged: "
                    + "; ".join(f"{x.div.pg}#{x.div.seq} ({who(bb.culprits)})"
                                for x, bb in found[1:]) + ".")
    # all members posted the seq and disagree: it can never complete
    # every member posted this seq and they disagree, or one side posted a block the other
    # never did and the two line up again after it: it can never complete
    same_seq = all(c is not None for c in g.div.per_rank.values()) and not g.absent
    # counts say one side posted more before a line, not what the extra was: likely
    certain = (Certainty.DEFINITE if (same_seq or g.block is not None) and b.confirmed
               and b.shift is None else Certainty.LIKELY)
    advice = KIND_ADVICE[g.div.kind](situation(f, g.div, b.culprits, b.basis)) \
        if b.shift is None else shifted(b.shift, f.views)[2]
    div = (shift_divergence(b.shift, advice.site, f.views) if b.shift else None) or g.div
    return Conclusion(Verdict.DESYNC, culprits, b.basis, certain, summary, advice,
                      div, [x.div for x, _ in found[1:]])


def _stack_desync(f: Facts) -> Conclusion:
    assert f.stack_div is not None
    div, culprits, basis = f.stack_div
    reports = f.reports(div)
    summary = desync_summary(div, reports, culprits, {}) + waited_text(f, div.per_rank) + (
        " (from stacks alone: the job's launch script dropped watch's probe, whose Flight "
        "Recorder dumps would name the group and sequence number)" if f.ev.sampled else
        " (from stacks alone: Flight Recorder dumps, e.g. by running under `moe-hang watch`, "
        "would name the group and sequence number)")
    views = f.views
    # a recv whose peer is a culprit, not a pass behind it (then the peer answered it)
    waiter = next((r for r in sorted(div.per_rank) if (p := views[r].stack.p2p) is not None
                   and p.op == "recv" and p.peer in culprits and pass_on(
                       views.source, views[r].user_frames_outer_first(), p.op,
                       views[p.peer].user_frames_outer_first()) is not True), None)
    if waiter is not None:  # a recv whose peer went on past the send it owed
        p2p = f.views[waiter].stack.p2p
        assert p2p is not None and p2p.peer is not None
        advice = advise_p2p(waiter, "recv", p2p.peer, f.views[waiter].site, f.views.source)
    elif div.kind == MismatchKind.EXTRA and (at := views[culprits[0]].site) is not None:
        # a camp a collective behind the ranks a pass on from it: one more before its line
        default = on_default_group(views.source, at.file, at.line) is True
        advice = count_advice(culprits, sorted(set(div.per_rank) - set(culprits)),
                              "default_pg" if default else "its group", at, True,
                              views.source, default)
    else:
        advice = KIND_ADVICE[div.kind](situation(f, div, culprits, basis))
    return Conclusion(Verdict.DESYNC, culprits, basis, Certainty.LIKELY, summary, advice, div)


def _held(f: Facts) -> Conclusion:
    """What the rest of the table concludes, as a hang: the watcher lived with this stall
    (uncertain) until --hang-after passed, and nothing moved."""
    out = _below_held(f).then(f)
    reason = f.ev.held or ""
    if out.verdict != Verdict.TRANSPORT_HANG:  # a hang of its own kind already
        out.verdict = Verdict.HANG
    out.summary = (reason[:1].upper() + reason[1:] + ". " if reason else "") + out.summary
    return out


def _below_held(f: Facts) -> Rule:
    return next(r for r in RULES[1:] if r.when(f))


def _said_with_doubts(out: Conclusion, f: Facts) -> Conclusion:
    """Where a rank's own sources disagree (reconcile.Disagreement) and the conclusion rests
    on that rank, it says so and is less certain."""
    involved = set(out.culprits) | (set(out.div.per_rank) if out.div is not None else set())
    doubts = sorted({d.rank for d in f.disagreements} & involved)
    if doubts:
        out.summary += (f" ({who(doubts).capitalize()}: {agree(doubts, 'its', 'their')} own "
                        f"records and {agree(doubts, 'its', 'their')} peers' disagree; see the "
                        "evidence.)")
        if out.certainty == Certainty.DEFINITE:
            out.certainty = Certainty.LIKELY
    return out


def _in_flight(f: Facts) -> bool:
    """Orphans of a dead launcher still stepping: a snapshot of ranks in flight (one already
    in the next collective) is not a desync."""
    return f.agent_died and (f.orphans_moving or not all(
        f.views[r].state == RankState.IN_COLLECTIVE for r in f.alive))


# nothing shows whether the ranks move: time alone (--hang-after) does not make that a hang
_UNSEEN = "in matching collectives, progress unseen"

# First match wins.
RULES: tuple[Rule, ...] = (
    Rule("held", "stall held past --hang-after",
         lambda f: f.ev.held is not None and _below_held(f).name != _UNSEEN
         and _below_held(f).then(f).certainty == Certainty.UNCERTAIN, _held,
         "hang (a transport hang stays one)", "as the rule it holds", "as the rule it holds"),
    Rule("finished", "every rank finished",
         lambda f: f.ev.job == JobState.COMPLETED or (bool(f.exited) and not f.alive
                                                and not f.bad_exit), _finished,
         "healthy", "—", "definite"),
    Rule("root_cause", "root-cause exception", lambda f: bool(f.root_causes), root_cause,
         "crash", "exception", "definite"),
    Rule("thread_order", "two threads post on one group",
         lambda f: f.thread_race is not None, thread_order, "desync", "thread_order",
         "definite"),
    Rule("size_abort", "gloo size abort", lambda f: f.size_abort is not None, _size_abort,
         "desync", "the ladder (history, majority, source, program order) or ambiguous",
         "definite; likely where one side is inferred"),
    Rule("killed", "rank killed or gone", lambda f: bool(f.killed), killed,
         "rank_died", "exited", "definite"),
    Rule("left_early", "rank left early", lambda f: bool(f.left), left_early,
         "rank_died", "exited", "definite"),
    Rule("ras_gone", "NCCL rank gone (RAS)", lambda f: gone(f) is not None, ras_rank_died,
         "rank_died", "exited", "definite (considered dead); likely"),
    Rule("ras_error", "NCCL error on a rank (RAS)", lambda f: nccl_errors(f) is not None,
         ras_rank_error, "crash", "nccl_error",
         "definite; likely for ncclRemoteError or an abort alone; uncertain on every rank"),
    Rule("unreached", "waits on unknown ranks", lambda f: bool(waits_on_unreached(f)),
         waiting_on_unreached, "hang", "none", "uncertain"),
    Rule("cycle", "wait-for cycle", lambda f: bool(f.wait_cycles) and not _in_flight(f),
         cycle, "desync (hang if only point-to-point)",
         "the ladder, else a count shift (majority), else cycle",
         "definite; likely on posting order alone (NCCL) or a count shift"),
    Rule("desync", "collective desync", lambda f: bool(desync_divs(f)) and not _in_flight(f),
         _desync, "desync", "the ladder (beside a count shift's two readings), else ambiguous",
         "definite, or likely (a count shift)"),
    Rule("stack_desync", "desync from stacks",
         lambda f: f.stack_div is not None and not _in_flight(f), _stack_desync,
         "desync", "the ladder without history, else ambiguous", "likely"),
    Rule("roots", "members name different roots",
         lambda f: root_camps(f) is not None and not _in_flight(f),
         roots_differ, "desync", "majority, else ambiguous", "likely"),
    Rule("p2p", "unmatched send/recv", lambda f: bool(unmatched(f.views)) and not _in_flight(f),
         unmatched_outcome, "hang", "program_order / waited_for / cycle",
         "likely, or uncertain"),
    Rule("ras_frozen", "frozen launch counts disagree (RAS)",
         lambda f: frozen_mismatch(f) is not None and not _in_flight(f), ras_desync,
         "desync", "launch_counts", "likely; uncertain when the recorder or stacks disagree"),
    Rule("launcher_died", "launcher died", lambda f: f.agent_died, agent_died,
         "crash", "—", "definite"),
    Rule("monitored_barrier", "monitored barrier names the laggards",
         lambda f: bool(barrier_laggards(f)), monitored_barrier,
         "hang", "waited_for", "likely"),
    Rule("timed_out", "timed out waiting for a rank outside collectives",
         lambda f: bool(f.bad_exit) and bool(outside_when_failed(f)), timed_out_waiting,
         "hang", "waited_for", "likely"),
    Rule("failed_elsewhere", "failed, other nodes unknown", failed_with_unknowns,
         failed_elsewhere, "crash", "—", "uncertain"),
    Rule("consequences", "failed with consequences only", lambda f: bool(f.bad_exit),
         consequences_only, "crash", "—", "uncertain"),
    Rule("finishing", "finished, the others returning from what it posted",
         lambda f: bool(f.finishing) and not f.left, finishing,
         "healthy", "—", "uncertain (watch watches on)"),
    Rule("moving", "every rank moving",
         lambda f: bool(f.alive) and len(f.moving) == len(f.alive), all_moving,
         "healthy", "—", "likely"),
    Rule("ras_moving", "NCCL launch counts moving (RAS)", ras_moving, ras_all_moving,
         "healthy", "—", "likely; uncertain while the ranks look stuck"),
    Rule("dumps_completed", "recorded collectives all completed", nothing_pending,
         all_completed, "inconclusive", "—", "uncertain"),
    Rule("outside", "stalled outside collectives", some_outside, stalled_outside,
         "hang", "waited_for; exception where its posting thread raised",
         "uncertain; likely where its thread that posts there has ended, definite where "
         "that thread raised"),
    Rule("straggler", "straggler", lambda f: bool(f.waiting) and bool(f.moving), straggler,
         "straggler", "waited_for", "uncertain"),
    Rule("transport", "transport or hardware hang", lambda f: transport(f) is not None,
         transport_hang, "transport_hang", "— / kernel_timing",
         "likely (recorder started everywhere and RAS frozen equal); uncertain with one"),
    Rule("ras_counts", "launch counts differ in one RAS report",
         lambda f: bool(counts_differ(f)), ras_one_poll_mismatch,
         "hang", "launch_counts", "uncertain"),
    Rule("ras_clean", "one RAS report, nothing wrong in it", ras_nothing_wrong,
         ras_one_poll_clean, "inconclusive", "—", "uncertain"),
    Rule("joining", "every rank inside a process group's creation", all_joining, stuck_joining,
         "hang where the stall is shown, else inconclusive", "—",
         "uncertain (a group slow to form looks the same)"),
    Rule("unseen", _UNSEEN, lambda f: in_one(f) and not stuck_shown(f), progress_unseen,
         "inconclusive", "—", "uncertain"),
    Rule("all_in_one", "all wait in matching collectives", in_one, all_in_one,
         "hang", "—", "uncertain"),
    Rule("inconclusive", "inconclusive", lambda f: True, inconclusive,
         "inconclusive", "—", "uncertain"),
)


def rule_table() -> str:
    """The rules in the order they are tried, as the README and docs/DESIGN.md show them."""
    rows = ["| rule_id | rule (first match wins) | verdict | culprit basis | certainty |",
            "|---|---|---|---|---|"]
    rows += [f"| `{r.id}` | {r.name} | {r.verdict} | {r.basis} | {r.certainty} |"
             for r in RULES]
    return "\n".join(rows) + "\n"


def diagnose(ev: Evidence) -> Diagnosis:
    f = facts(ev)
    rule = next(r for r in RULES if r.when(f))
    out = _said_with_doubts(rule.then(f), f)
    reports = f.reports(out.div)
    ranks = sorted([*reports.values(), *unreached_reports(ev.unreached, set(reports))],
                   key=lambda x: x.rank)
    return Diagnosis(
        verdict=out.verdict, summary=out.summary, culprit_ranks=sorted(out.culprits),
        first_divergence=out.div, ranks=ranks, fix=out.advice.text,
        fix_code=out.advice.code, fix_site=out.advice.site, fix_site_why=out.advice.site_why,
        artifacts=ev.artifacts,
        evidence=f.evidence + unreached_line(ev.unreached)
        + (f.ras.lines() if f.ras is not None else []),
        timeline=build_timeline(f.views, out.div), culprit_basis=out.basis,
        certainty=out.certainty, rule=rule.name, rule_id=rule.id,
        divergences=[out.div, *out.more] if out.div is not None else [],
        nccl_ras=ras_summary(f.ras), routing=routing_report(ev))

