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
from pathlib import Path

from moe_hang.analysis.activity import Motion
from moe_hang.analysis.advice import (
    KIND_ADVICE,
    Advice,
    Situation,
    advise_condition,
    advise_p2p,
)
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.culprit import (
    Blame,
    blame_abort,
    blame_cycle,
    condition_on,
    cycle_inversion,
)
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Diagnosis,
    Divergence,
    MismatchKind,
    Verdict,
    pg_label,
)
from moe_hang.analysis.dumps_only import all_completed, nothing_pending, outside_recorded
from moe_hang.analysis.explain import (
    abort_detail,
    block_summary,
    culprit_clause,
    desync_summary,
    site_str,
    waits_text,
)
from moe_hang.analysis.facts import Facts, desync_divs, facts, stuck_shown
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
from moe_hang.analysis.fallback import mark_skipped
from moe_hang.analysis.nccl import (
    counts_differ,
    frozen_mismatch,
    gone,
    nccl_errors,
    ras_all_moving,
    ras_desync,
    ras_lines,
    ras_moving,
    ras_nothing_wrong,
    ras_one_poll_clean,
    ras_one_poll_mismatch,
    ras_rank_died,
    ras_rank_error,
    ras_summary,
)
from moe_hang.analysis.order import Inversion
from moe_hang.analysis.p2p import unmatched, unmatched_outcome
from moe_hang.analysis.source import excludes_ranks
from moe_hang.analysis.timeline import build_timeline, group_kind, recorder_only, to_rc
from moe_hang.analysis.transport import transport, transport_hang
from moe_hang.analysis.unreached import (
    failed_elsewhere,
    failed_with_unknowns,
    unreached_line,
    unreached_reports,
    waiting_on_unreached,
    waits_on_unreached,
)
from moe_hang.analysis.waitfor import Edge
from moe_hang.analysis.wronggroup import WrongGroup, wrong_group
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.stacks import idle_in_backward
from moe_hang.evidence.vocab import JobState, RankState, agree, spans, who


@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[Facts], bool]
    then: Callable[[Facts], Conclusion]


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
    """gloo aborted a rank for a size mismatch: the recorder's alignment says where, when the
    survivors' records reach it; else the abort itself does."""
    assert f.size_abort is not None
    div, aborted = f.size_abort
    detail = abort_detail(aborted, f.ev.size_abort)
    if desync_divs(f):
        out = _desync(f)
        confirmed = True
        if out.basis in (CulpritBasis.AMBIGUOUS, CulpritBasis.HISTORY) and out.div is not None:
            # the aborted rank left no recorder entry: the abort's byte counts may decide
            # (its side of this very collective: stronger than what earlier steps did)
            b = blame_abort(out.div, f.views, f.ev.size_abort, aborted)
            if b.basis != CulpritBasis.AMBIGUOUS:
                out.culprits, out.basis, confirmed = b.culprits, b.basis, b.confirmed
                out.summary += culprit_clause(b.basis, b.culprits, b.confirmed)
        if out.div is not None and mark_skipped(out.div, out.culprits, out.basis, aborted, f.views):
            out.summary = desync_summary(out.div, f.reports(out.div), out.culprits, {}) \
                + culprit_clause(out.basis, out.culprits, confirmed)
        out.summary = out.summary.rstrip(".") + f" ({detail})."
        # the mismatch is certain; a culprit read off one side's history alone is likely
        out.certainty = Certainty.DEFINITE if confirmed else Certainty.LIKELY
        return out
    b = blame_abort(div, f.views, f.ev.size_abort, aborted)
    mark_skipped(div, b.culprits, b.basis, aborted, f.views)
    reports = f.reports(div)
    exits = {r: f.ev.ranks[r].exit_code for r in f.bad_exit}
    summary = desync_summary(div, reports, b.culprits, exits).rstrip(".") + f" ({detail})."
    summary += culprit_clause(b.basis, b.culprits, b.confirmed)
    certainty = Certainty.DEFINITE if b.confirmed else Certainty.LIKELY
    return Conclusion(Verdict.DESYNC, b.culprits, b.basis, certainty, summary,
                      KIND_ADVICE[div.kind](_situation(f, div, b.culprits, b.basis)), div)


def _cycle_condition(cyc: list[Edge], culprits: set[int], f: Facts) -> Advice | None:
    """The advice where a rank condition set the culprits apart: those that skipped what their
    waiter waits in (an edge on them), else those waiting in an extra of their own."""
    found: list[tuple[int, Advice]] = []
    for e in cyc:
        if e.coll is None:
            continue
        cond = condition_on(e.coll, f.views[e.waiter])
        if cond is None:
            continue
        what = f"{e.coll.op} {pg_label(e.coll.pg, e.coll.pg_desc)}"
        site = f.views[e.waiter].site
        if e.on in culprits and e.waiter not in culprits:
            found.append((1, advise_condition(sorted(culprits), e.waiter, what, site, cond,
                                              True)))
        if e.waiter in culprits and e.on not in culprits and not excludes_ranks(cond):
            # the branch the culprits took, named as such: clearer than the one they left
            found.append((0, advise_condition(sorted(culprits), e.on, what, site, cond,
                                              False)))
    return min(found, key=lambda x: x[0])[1] if found else None


def _cycle(f: Facts) -> Conclusion:
    cyc = f.wait_cycles[0]
    b = blame_cycle(cyc, f.views)
    culprits = set(b.culprits)
    for other in f.wait_cycles[1:]:
        culprits |= set(blame_cycle(other, f.views).culprits)
    if redirected := _redirected(f):
        # a rank that posted a line's collective on another group than every earlier call
        # and its waiter did is the cause, wherever it sits on the cycle (on a mesh the
        # ranks it went ahead with may be the ones the cycle passes through)
        b = Blame(sorted({w.rank for w in redirected}), CulpritBasis.HISTORY)
        culprits = set(b.culprits)
    p2p_only = all(e.coll is None for e in cyc)
    verdict = Verdict.HANG if p2p_only else Verdict.DESYNC
    # posting order alone (NCCL: both enqueued, kernels on two streams): it hung, and this
    # order explains it, but another cause could too
    certainty = Certainty.LIKELY if any(e.stream for e in cyc) else Certainty.DEFINITE
    inv = cycle_inversion(cyc, f.views) if b.basis in (CulpritBasis.HISTORY,
                                                       CulpritBasis.MAJORITY) else None
    if inv is not None:
        return _inverted(f, cyc, inv, verdict, certainty)
    parts = [f"rank {e.waiter} waits in {e.what}"
             + (f" at {site_str(f.views[e.waiter].site)}" if f.views[e.waiter].site else "")
             + f" for rank {e.on}" for e in cyc]
    summary = "Deadlock: " + "; ".join(parts) + "."
    if len(f.wait_cycles) > 1:
        summary += f" ({len(f.wait_cycles) - 1} more cycle(s) like it.)"
    summary += culprit_clause(b.basis, sorted(culprits), b.confirmed)
    if p2p_only and b.basis == CulpritBasis.CYCLE:
        text = ("Each rank waits to receive before it sends: order the calls so one side sends "
                "first (e.g. even ranks send then receive, odd ranks receive then send), or "
                "post both with isend/irecv (dist.batch_isend_irecv) and wait on them.")
    elif b.basis == CulpritBasis.CYCLE:
        text = ("The ranks post these collectives in opposite orders: post collectives on every "
                "group in the same order on every rank.")
    elif wrong := (redirected or _wrong_groups(culprits, f)):
        w = wrong[0]
        names = who(x.rank for x in wrong)
        used, meant = pg_label(w.used, w.used_desc), pg_label(w.meant, w.meant_desc)
        at = f" at {Path(w.site[0]).name}:{w.site[1]}" if w.site else ""
        held = f.views[w.rank]
        mine = [e for e in f.wait_edges if e.waiter == w.rank]
        now = next((e.what for c in f.wait_cycles for e in c if e.waiter == w.rank), None)
        if any(e.coll is not None and (e.coll.pg, e.coll.seq) == (w.used, w.seq)
               for e in mine):
            # still in the redirected call: the group it went to has moved on without it
            then = f" and waits in it for {who(sorted({e.on for e in mine}))}"
        else:
            then = f" and went on to {now} at {site_str(held.site)}" if now else ""
        meant_kind = w.meant_desc if w.meant_desc not in ("", "undefined") else w.meant
        # those held up by the redirect: waiting on a culprit in its op on the group meant
        waiters = sorted({e.waiter for e in f.wait_edges if e.on in culprits and e.coll
                          and e.coll.op == w.op and group_kind(e.coll) == meant_kind}
                         - culprits) \
            or sorted({e.waiter for c in f.wait_cycles for e in c} - culprits)
        # the redirect is the cause: it leads; the cycle is what it led to
        summary = (f"{names.capitalize()} posted the {w.op}{at} on {used} instead of {meant}"
                   + then + f"; {who(waiters)} "
                   + ("waits" if len(waiters) == 1 else "wait")
                   + f" for {'it' if len(wrong) == 1 else 'them'} in {w.op} on {meant}.")
        text = (f"{names.capitalize()} passed {used} to the {w.op}{at} where the other "
                f"ranks passed {meant}: pass the same group (the same mesh dim) on every rank.")
    elif (p2p := next((e for e in cyc if e.on in culprits and e.p2p is not None), None)) \
            and p2p.p2p is not None:
        text = advise_p2p(p2p.waiter, p2p.p2p.op, p2p.on, f.views[p2p.waiter].site).text
    elif b.basis == CulpritBasis.SOURCE and (cond := _cycle_condition(cyc, culprits, f)):
        text = cond.text
    else:
        waiter = next(e.waiter for e in cyc if e.on in culprits)
        them = "it" if len(culprits) == 1 else "them"
        text = (f"{who(sorted(culprits)).capitalize()} went past what rank {waiter} waits in "
                f"({next(e.what for e in cyc if e.on in culprits)} at "
                f"{site_str(f.views[waiter].site)}): make {them} post that too, in the same "
                "order.")
    on_cycle = [g for g in f.divs if any(e.coll is not None and e.coll.pg == g.div.pg
                                          for e in cyc)]
    # show the group that a culprit skipped (not the one it is held up in)
    div = next((g.div for g in on_cycle if set(g.absent) & culprits),
               on_cycle[0].div if on_cycle else None)
    if redirected:  # show the group it was meant for, where the others wait for it
        kind = redirected[0].meant_desc or redirected[0].meant
        div = next((g.div for g in f.divs if set(g.absent) & culprits
                    and (g.div.pg_desc or g.div.pg) == kind), div)
    return Conclusion(verdict, sorted(culprits), b.basis, certainty, summary, Advice(text), div)


def _inverted(f: Facts, cyc: list[Edge], inv: Inversion, verdict: Verdict,
              certainty: Certainty) -> Conclusion:
    def name(c: Collective) -> str:
        return f"{c.op} {pg_label(c.pg, c.pg_desc)}#{c.seq}"  # the lines: below the summary

    why = ("as every rank did in earlier steps" if inv.basis == CulpritBasis.HISTORY
           else f"{len(inv.others)} of {len(inv.others) + len(inv.culprits)} ranks")
    summary = (f"{who(inv.culprits).capitalize()} posted {name(inv.first)} before "
               f"{name(inv.second)}; {who(inv.others)} posted them the other way "
               f"round ({why}): each waits for the other.")
    text = (f"Make {who(inv.culprits)} post {inv.second.op} on "
            f"{pg_label(inv.second.pg, inv.second.pg_desc)} before {inv.first.op} on "
            f"{pg_label(inv.first.pg, inv.first.pg_desc)}, like the others: collectives on "
            "every group in the same order on every rank.")
    # what each side is held in: the culprits the one they posted first, the others theirs
    per_rank = {r: to_rc(f.views[r].current, f.views[r]) for r in inv.culprits + inv.others}
    div = Divergence(inv.second.pg, inv.second.seq, MismatchKind.ORDER, inv.second.pg_desc,
                     sorted(inv.culprits + inv.others), per_rank, phase="order")
    return Conclusion(verdict, inv.culprits, inv.basis, certainty, summary, Advice(text), div)


def _redirected(f: Facts) -> list[WrongGroup]:
    """Every rank some waiter waits on that posted what it waits in on another group — one
    mistake (one line, one group used) on fewer than all the ranks waited on; else none."""
    found: dict[int, WrongGroup] = {}
    for e in f.wait_edges:
        if e.coll is not None and e.on not in found and e.on in f.views and \
                (w := wrong_group(e.on, e.coll, e.waiter, f.views)) is not None:
            found[e.on] = w
    waited_on = {e.on for e in f.wait_edges}
    if not found or len({(w.site, w.used_desc or w.used) for w in found.values()}) != 1 \
            or len(found) >= len(waited_on):
        return []
    return [found[r] for r in sorted(found)]


def _wrong_groups(culprits: set[int], f: Facts) -> list[WrongGroup]:
    """Each culprit that posted what its waiter waits in on another group (all or none)."""
    found = []
    for r in sorted(culprits):
        e = next((e for c in f.wait_cycles for e in c if e.on == r and e.coll is not None),
                 None)
        w = wrong_group(r, e.coll, e.waiter, f.views) if e is not None and e.coll else None
        if w is None:
            return []
        found.append(w)
    return found if len({(w.site, w.used_desc or w.used) for w in found}) == 1 else []


def _desync(f: Facts) -> Conclusion:
    found = desync_divs(f)
    g, b = found[0]
    culprits = sorted({r for _, bb in found for r in bb.culprits})
    reports = f.reports(g.div)
    exits = {r: f.ev.ranks[r].exit_code for r in f.bad_exit}
    if g.block is not None:
        summary = block_summary(g, reports)
    else:
        summary = desync_summary(g.div, reports, b.culprits, exits)
        summary += culprit_clause(b.basis, b.culprits, b.confirmed)
    if len(found) > 1:
        summary += (f" {len(found) - 1} more group(s) diverged: "
                    + "; ".join(f"{x.div.pg}#{x.div.seq} ({who(bb.culprits)})"
                                for x, bb in found[1:]) + ".")
    # all members posted the seq and disagree: it can never complete
    # every member posted this seq and they disagree, or one side posted a block the other
    # never did and the two line up again after it: it can never complete
    same_seq = all(c is not None for c in g.div.per_rank.values()) and not g.absent
    certain = (Certainty.DEFINITE if (same_seq or g.block is not None) and b.confirmed
               else Certainty.LIKELY)
    return Conclusion(Verdict.DESYNC, culprits, b.basis, certain, summary,
                      KIND_ADVICE[g.div.kind](_situation(f, g.div, b.culprits, b.basis)),
                      g.div, [x.div for x, _ in found[1:]])


def _stack_desync(f: Facts) -> Conclusion:
    assert f.stack_div is not None
    div, culprits, basis = f.stack_div
    reports = f.reports(div)
    summary = desync_summary(div, reports, culprits, {}) + (
        " (from stacks alone: the job's launch script dropped watch's probe, whose Flight "
        "Recorder dumps would name the group and sequence number)" if f.ev.sampled else
        " (from stacks alone: Flight Recorder dumps, e.g. by running under `moe-hang watch`, "
        "would name the group and sequence number)")
    waiter = next((r for r in sorted(div.per_rank) if (p := f.views[r].stack.p2p) is not None
                   and p.op == "recv" and p.peer in culprits), None)
    if waiter is not None:  # a recv whose peer went on past the send it owed
        p2p = f.views[waiter].stack.p2p
        assert p2p is not None and p2p.peer is not None
        advice = advise_p2p(waiter, "recv", p2p.peer, f.views[waiter].site)
    else:
        advice = KIND_ADVICE[div.kind](_situation(f, div, culprits, basis))
    return Conclusion(Verdict.DESYNC, culprits, basis, Certainty.LIKELY, summary, advice, div)


def _outside(f: Facts) -> list[int]:
    """Waiting ranks that are not inside a collective (idle in a sleep, a lock, a read).
    Where no rank's stack shows a collective, ranks idle inside the autograd engine wait in
    their backward's collectives (DDP's and FSDP's hooks post them there, on threads py-spy
    does not show): the others are outside (fuzz seed 4071993 job 81: one rank deadlocked
    on two locks before its forward, three idle in ``loss.backward()``)."""
    out = sorted(r for r in f.waiting if f.views[r].state != RankState.IN_COLLECTIVE)
    back = [r for r in out if idle_in_backward(f.views[r].stack)]
    if len(out) == len(f.waiting) and 0 < len(back) < len(out):
        return [r for r in out if r not in back]
    return out


def _stalled_outside(f: Facts) -> Conclusion:
    culprits = _outside(f)
    reports = f.reports(None)
    w = waits_text(f, reports)
    div = next((g.div for g in f.divs if set(g.absent) & set(culprits)), None)
    site = f.views[culprits[0]].site
    if all(recorder_only(f.views[r].ev) for r in culprits):
        return outside_recorded(f, culprits, w, div)
    where = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    back = [r for r in f.waiting if r not in culprits and idle_in_backward(f.views[r].stack)]
    if back and not w:
        sites = sorted({site_str(f.views[r].site) for r in back})
        w = f"{who(back)}, idle inside backward at {', '.join(sites)},"
    # one waiter only where the text names one rank ("ranks 1-3 in ..." is three)
    one = w.startswith("rank ") and w.count("rank") == 1
    summary = (f"{who(culprits).capitalize()} {agree(culprits, 'is', 'are')} outside any "
               f"collective ({where}) while "
               f"{w or 'the others'} wait{'s' if one else ''} for it.")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      summary,
                      Advice(f"Look at what rank {culprits[0]} does at {site_str(site)}: until it "
                             "reaches the collective the others wait in, they wait (slow I/O or "
                             "a checkpoint resolves by itself; a stuck data loader does not)."),
                      div)


def _finishing(f: Facts) -> Conclusion:
    """A rank's program ended, having posted every collective the others wait in: they are
    returning from the last ones (a job finishing one rank at a time), not left waiting."""
    done = f.finishing
    waits = sorted({(pg_label(c.pg, c.pg_desc), c.seq) for r in f.waiting
                    if (c := f.views[r].current) is not None})
    upto = ", ".join(f"{pg} #{seq}" for pg, seq in waits)
    # uncertain: a claim about a job still running, which watch keeps watching
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
                      f"{who(done).capitalize()} finished after posting every collective "
                      f"{who(f.waiting)} {agree(f.waiting, 'waits', 'wait')} in"
                      f"{f' ({upto})' if upto else ''}: "
                      f"{agree(f.waiting, 'it is', 'they are')} returning from "
                      f"{agree(f.waiting, 'its', 'their')} last collectives, not left "
                      "waiting.")


def _straggler(f: Facts) -> Conclusion:
    culprits = sorted(f.moving)
    return Conclusion(Verdict.STRAGGLER, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      f"{who(culprits).capitalize()} {'is' if len(culprits) == 1 else 'are'} "
                      f"still computing while {who(f.waiting)} "
                      f"wait{'s' if len(f.waiting) == 1 else ''} in a collective: slow, not "
                      "deadlocked.",
                      Advice("Not a deadlock: a rank is still computing while the others wait. "
                             "Look at what it computes (its stack); balance the work, or raise "
                             "the timeout."))


def _all_moving(f: Facts) -> Conclusion:
    # the counters first: they saw collectives complete, where a stack saw one collective
    counted = sorted(r for r in f.alive
                     if (j := f.activity.get(r)) is not None and j.motion == Motion.MOVING)
    stacked = sorted(r for r in f.alive if r not in counted)
    parts = []
    if stacked:
        parts.append("their stacks moved between samples" if not counted
                     else f"{who(stacked)}'s stack moved between samples" if len(stacked) == 1
                     else f"the stacks of {who(stacked)} moved between samples")
    if counted:
        ops = {f.views[r].stack.op or "a collective" for r in counted}
        op = ops.pop() if len(ops) == 1 else "collectives"
        one = len(counted) == 1
        parts.append(f"{who(counted)} {'was' if one else 'were'} in {op} in every sample, a "
                     f"new one each time: {'its main thread' if one else 'their main threads'}"
                     f" kept waking and {'its process' if one else 'their processes'} kept "
                     "moving data through syscalls (counters in the evidence)")
    return Conclusion(Verdict.HEALTHY, [], CulpritBasis.NONE, Certainty.LIKELY,
                      f"All {len(f.alive)} ranks are making progress: {'; '.join(parts)}. No "
                      "hang right now.")


def _all_in_one(f: Facts) -> Conclusion:
    reports = f.reports(None)
    ops = {c.op if (c := reports[r].collective) else (
        f.views[r].stack.op or ("backward" if f.views[r].stack.in_backward else "?"))
        for r in f.waiting}
    op = ops.pop() if len(ops) == 1 else "collectives"
    stopped = sorted(r for r in f.waiting if (a := f.views[r].ev.activity) is not None
                     and a.stopped)
    if all(f.views[r].ev.fr is not None for r in f.waiting):
        summary = (f"All {len(f.waiting)} ranks wait in {op} with matching order and sizes, "
                   "and it does not complete: the collective order is consistent, so the "
                   "cause is outside it")
    else:  # stacks (or heartbeats) alone show where each waits, not what it posted before
        summary = (f"All {len(f.waiting)} ranks wait in {op}, and it does not complete"
                   + ("" if stopped else
                      "; without every rank's Flight Recorder dump their collective order "
                      "and sizes cannot be compared (run it under `moe-hang watch`, whose "
                      "probe keeps the recorder)"))
    summary += (f": {who(stopped)}'s process is stopped (SIGSTOP, job control)." if stopped
                else ".")
    nccl = any(v.ev.fr is not None and v.ev.fr.backend == "nccl" for v in f.views.values())
    text = ("Suspect the transport or a device (NCCL_DEBUG=INFO shows the rings; a peer "
            "outside this job, a hung GPU)." if nccl else "")
    return Conclusion(Verdict.HANG, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
                      Advice(text))


def _in_one(f: Facts) -> bool:
    return bool(f.waiting) and len(f.waiting) == len(f.alive)


def _progress_unseen(f: Facts) -> Conclusion:
    """Every rank sat in the same kind of collective in every sample, and nothing shows
    whether it is one that never completes or a new one each time (docs/DESIGN.md §9)."""
    reports = f.reports(None)
    ops = {c.op if (c := reports[r].collective) else (
        f.views[r].stack.op or ("backward" if f.views[r].stack.in_backward else "?"))
        for r in f.waiting}
    op = ops.pop() if len(ops) == 1 else "collectives"
    whys: dict[str, list[int]] = {}
    for r in f.waiting:
        j = f.activity.get(r)
        whys.setdefault(j.why if j is not None and j.motion != Motion.STUCK
                        else "no counters" if j is None else "", []).append(r)
    clauses = [f"{who(rs)}: {w}" for w, rs in whys.items() if w and w != "no counters"]
    if "no counters" in whys:
        clauses.append(f"{who(whys['no counters'])}: no counters were read")
    summary = (f"All {len(f.waiting)} ranks were in {op} in every sample, and what their "
               "processes did cannot tell one collective that never completes from a new one "
               "each time (" + "; ".join(clauses) + ").")
    text = ("Decide with the recorder: keep watch's probe in the ranks (the launch script "
            "dropped it: let it keep PYTHONPATH, or call torchrun by name), or `moe-hang "
            "diagnose PID --fr-dir DIR` with the job's own Flight Recorder dumps."
            if f.ev.sampled else
            "Decide with the recorder: run the job under `moe-hang watch -- <launch command>` "
            "(its probe reads the Flight Recorder's sequence numbers), or pass `--fr-dir DIR` "
            "with the job's own Flight Recorder dumps (TORCH_FR_BUFFER_SIZE, "
            "TORCH_FR_DUMP_TEMP_FILE).")
    return Conclusion(Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
                      Advice(text))


def _inconclusive(f: Facts) -> Conclusion:
    known = [r for r, v in f.views.items() if v.state != RankState.UNKNOWN]
    return Conclusion(Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
                      "Not enough evidence to name a cause: "
                      + (f"states known for rank {spans(known)} only." if known
                         else "no stack or recorder data could be read."))


def _situation(f: Facts, div: Divergence, culprits: list[int],
               basis: CulpritBasis) -> Situation:
    frames = {}
    for r, v in f.views.items():
        coll = v.tl.by_pg.get(div.pg, {}).get(div.seq) if div.seq is not None else None
        frames[r] = (coll.frames if coll is not None and coll.frames else v.stack.frames)
    block = next((g.block for g in f.divs if g.div is div), None)
    return Situation(div, culprits, basis, f.reports(div), frames, block)


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
    Rule("stall held past --hang-after",
         lambda f: f.ev.held is not None and _below_held(f).name != _UNSEEN
         and _below_held(f).then(f).certainty == Certainty.UNCERTAIN, _held),
    Rule("every rank finished",
         lambda f: f.ev.job == JobState.COMPLETED or (bool(f.exited) and not f.alive
                                                and not f.bad_exit), _finished),
    Rule("root-cause exception", lambda f: bool(f.root_causes), root_cause),
    Rule("gloo size abort", lambda f: f.size_abort is not None, _size_abort),
    Rule("rank killed or gone", lambda f: bool(f.killed), killed),
    Rule("rank left early", lambda f: bool(f.left), left_early),
    Rule("NCCL rank gone (RAS)", lambda f: gone(f) is not None, ras_rank_died),
    Rule("NCCL error on a rank (RAS)", lambda f: nccl_errors(f) is not None, ras_rank_error),
    Rule("waits on unknown ranks", lambda f: bool(waits_on_unreached(f)), waiting_on_unreached),
    Rule("wait-for cycle", lambda f: bool(f.wait_cycles) and not _in_flight(f), _cycle),
    Rule("collective desync", lambda f: bool(desync_divs(f)) and not _in_flight(f), _desync),
    Rule("desync from stacks", lambda f: f.stack_div is not None and not _in_flight(f),
         _stack_desync),
    Rule("unmatched send/recv", lambda f: bool(unmatched(f.views)) and not _in_flight(f),
         unmatched_outcome),
    Rule("frozen launch counts disagree (RAS)",
         lambda f: frozen_mismatch(f) is not None and not _in_flight(f), ras_desync),
    Rule("launcher died", lambda f: f.agent_died, agent_died),
    Rule("monitored barrier names the laggards", lambda f: bool(barrier_laggards(f)),
         monitored_barrier),
    Rule("timed out waiting for a rank outside collectives",
         lambda f: bool(f.bad_exit) and bool(outside_when_failed(f)), timed_out_waiting),
    Rule("failed, other nodes unknown", failed_with_unknowns, failed_elsewhere),
    Rule("failed with consequences only", lambda f: bool(f.bad_exit), consequences_only),
    Rule("finished, the others returning from what it posted",
         lambda f: bool(f.finishing) and not f.left, _finishing),
    Rule("every rank moving", lambda f: bool(f.alive) and len(f.moving) == len(f.alive),
         _all_moving),
    Rule("NCCL launch counts moving (RAS)", ras_moving, ras_all_moving),
    Rule("recorded collectives all completed", nothing_pending, all_completed),
    Rule("stalled outside collectives",
         lambda f: bool(_outside(f)) and len(_outside(f)) < len(f.waiting), _stalled_outside),
    Rule("straggler", lambda f: bool(f.waiting) and bool(f.moving), _straggler),
    Rule("transport or hardware hang", lambda f: transport(f) is not None, transport_hang),
    Rule("launch counts differ in one RAS report", lambda f: bool(counts_differ(f)),
         ras_one_poll_mismatch),
    Rule("one RAS report, nothing wrong in it", ras_nothing_wrong, ras_one_poll_clean),
    Rule(_UNSEEN,
         lambda f: _in_one(f) and not stuck_shown(f), _progress_unseen),
    Rule("all wait in matching collectives", _in_one, _all_in_one),
    Rule("inconclusive", lambda f: True, _inconclusive),
)


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
        fix_code=out.advice.code, artifacts=ev.artifacts,
        evidence=f.evidence + unreached_line(ev.unreached) + ras_lines(ev),
        timeline=build_timeline(f.views, out.div), culprit_basis=out.basis,
        certainty=out.certainty, rule=rule.name,
        divergences=[out.div, *out.more] if out.div is not None else [],
        nccl_ras=ras_summary(ev))

