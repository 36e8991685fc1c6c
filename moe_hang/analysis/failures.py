"""The rules' outcomes when ranks failed or left: an exception of their own, a kill, an early
exit, a dead launcher, a timeout waiting for a rank outside collectives (pure)."""

from __future__ import annotations

import signal

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Verdict
from moe_hang.analysis.explain import error_text, site_str, waits_text
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.routing import block_label, routing_report
from moe_hang.evidence.errors import is_consequence, is_mismatch_report, monitored_barrier_laggards
from moe_hang.evidence.model import Evidence, RankError, Restarts
from moe_hang.evidence.stacks import callsite, collective_of
from moe_hang.evidence.vocab import RankState, agree, exit_desc, who


def root_cause(f: Facts) -> Conclusion:
    same = _same_error(f)
    if same is not None:
        return same
    rank = _earliest(f)
    if rank is None:  # several, and nothing says which came first: every one is named
        ranks = sorted(f.root_causes)
        return Conclusion(Verdict.CRASH, ranks, CulpritBasis.EXCEPTION, Certainty.DEFINITE,
                          f"{who(ranks).capitalize()} raised errors of their own ("
                          + "; ".join(f"rank {r}: {error_text(f.root_causes[r], 80)}"
                                      for r in ranks) + "); which came first is not recorded.",
                          Advice("Fix each of these errors; the other ranks only fail because "
                                 "these left."))
    err = f.root_causes[rank]
    site = callsite(err.frames)
    others = sorted(set(f.root_causes) - {rank})
    after = sorted(set(f.consequences) | set(f.bad_exit) - set(f.root_causes) - {rank})
    summary = f"Rank {rank} raised {error_text(err)}" + (
        f" at {site.short()}" if site else "") + "."
    if after:
        summary += (f" {who(after).capitalize()} then failed as a consequence"
                    + (f" ({error_text(f.consequences[after[0]], 80)})"
                       if after[0] in f.consequences else "") + ".")
    if others:
        summary += f" {who(others).capitalize()} raised errors too, later."
    # the others' failures follow from its leaving only where they are consequences of it
    text = (f"Fix the {err.type.rsplit('.', 1)[-1]} rank {rank} raised"
            + (f" at {site.short()}" if site else "")
            + (f"; {who(others)} raised "
               f"{'an error of its' if len(others) == 1 else 'errors of their'} own too "
               "(--verbose)." if others
               else ": the other ranks only failed because it left."))
    text = _special_advice(f, err, [rank]) or text
    return Conclusion(Verdict.CRASH, [rank], CulpritBasis.EXCEPTION, Certainty.DEFINITE, summary,
                      Advice(text))


def _same_error(f: Facts) -> Conclusion | None:
    """Several ranks raised one error — its type, its first sentence, at one line of the job
    outside any collective — each of its own, and no rank died, was killed or left: the
    code's error, every one of those ranks', not one rank's whose leaving failed the rest.
    None where their errors differ, where one is raised inside a collective (several ranks'
    identical error there is how a peer's failure usually reads), or where a rank ended
    another way (its ending may be the cause)."""
    roots = f.root_causes
    # the rest ended of a consequence (a peer's closed connection), or torchrun's SIGTERM
    torn = {r for r in set(f.bad_exit) - set(roots) - set(f.consequences)
            if f.ev.ranks[r].exit_code != -signal.SIGTERM}
    if len(roots) < 2 or f.killed or f.left or torn:
        return None
    keys = {r: (e.type, error_text(e), callsite(e.frames)) for r, e in roots.items()}
    if len(set(keys.values())) != 1:
        return None
    ranks = sorted(roots)
    err = roots[ranks[0]]
    site = callsite(err.frames)
    if site is None or collective_of(err.frames)[0] is not None:
        return None
    at = f" at {site.short()}"
    every = set(ranks) == set(f.views) and f.ev.unreached is None
    them = "every rank" if every else who(ranks)
    special = _special_advice(f, err, ranks)
    after = sorted(set(f.consequences) - set(roots))
    then = (f" {who(after).capitalize()} then failed as a consequence "
            f"({error_text(f.consequences[after[0]], 80)})." if after else "")
    return Conclusion(Verdict.CRASH, ranks, CulpritBasis.EXCEPTION, Certainty.DEFINITE,
                      f"{them[0].upper()}{them[1:]} raised {error_text(err)}{at}: the same "
                      f"error on each, its own (none failed because another left).{then}",
                      Advice(special or f"Fix the {err.type.rsplit('.', 1)[-1]}{at}: {them} "
                             "met it."))


def _special_advice(f: Facts, err: RankError, ranks: list[int]) -> str | None:
    """What an error's own words call for, where they name its cause: a rank that routed no
    token into an MoE block (nothing that trains in its loss), DDP's unused parameters."""
    if "does not require grad" in err.message:
        empty = {r: b for r in ranks if (b := _no_token_block(f.ev, r)) is not None}
        if empty:
            r0 = min(empty)
            return (f"{who(sorted(empty)).capitalize()} routed no token into {empty[r0]}, so "
                    "nothing that trains was in the loss's graph and the backward had nothing "
                    "to run. Anchor each MoE block's output to its experts' parameters (y = y "
                    "+ sum(p.sum() for p in experts.parameters()) * 0; "
                    "moe_hang.anchor_gradients) so every rank's backward runs, and posts its "
                    "collectives, with or without tokens.")
    elif "find_unused_parameters" in err.message:
        return (f"DistributedDataParallel says some parameters of {who(ranks)} took no part "
                "in the loss: pass find_unused_parameters=True to DistributedDataParallel, or "
                "make every rank use every parameter every step.")
    return None


def _no_token_block(ev: Evidence, rank: int) -> str | None:
    """The MoE block ``rank`` sent no token into at the step it stopped in, where another rank
    sent some (its routers' counts say so); None: they do not."""
    report = routing_report(ev)
    gap = next((g for g in report.ragged if g.tokens.get(rank) == 0), None) if report else None
    return None if gap is None else f"{block_label(gap.block)} at step {gap.step}"


def _earliest(f: Facts) -> int | None:
    """The first root cause: by the times the probe recorded (all ranks'), else torchrun's
    "first observed failure", else the order the log printed them in; None when nothing
    orders several."""
    roots = f.root_causes
    if len(roots) == 1:
        return next(iter(roots))
    if all(e.time is not None for e in roots.values()):
        return min(roots, key=lambda r: roots[r].time or 0.0)
    if f.ev.root_cause_rank in roots:
        return f.ev.root_cause_rank
    if all(e.seen_at is not None for e in roots.values()):
        return min(roots, key=lambda r: roots[r].seen_at or 0)
    return None


def killed(f: Facts) -> Conclusion:
    reports = f.reports(None)
    w = waits_text(f, reports)
    dead = f.ev.ranks[f.killed[0]]
    one = len(f.killed) == 1
    if dead.exit_code is None:
        how = (f"{agree(f.killed, 'is', 'are')} gone (no process, no exception, no exit code) "
               "mid-step")
    else:
        how = f"{agree(f.killed, 'was', 'were')} {exit_desc(dead.exit_code)} mid-step"
    summary = f"{who(f.killed).capitalize()} {how}" + (
        f" while {w} waited for {'it' if one else 'them'}." if w else ".")
    kill9 = any(f.ev.ranks[r].exit_code in (-9, None) for r in f.killed)
    text = ("Find out why it died: SIGKILL with no message is usually the OOM killer (check "
            "`dmesg` / the node's memory); the others only wait for it." if kill9 else
            "Find out why it died (its stack is in the run directory); the others only wait "
            "for it.")
    return Conclusion(Verdict.RANK_DIED, f.killed, CulpritBasis.EXITED, Certainty.DEFINITE,
                      summary, Advice(text))


def left_early(f: Facts) -> Conclusion:
    reports = f.reports(None)
    w = waits_text(f, reports)
    summary = (f"{who(f.left).capitalize()} exited (its interpreter shut down normally) before "
               "the others while " + (w or f"{who(f.waiting)}") + " waited for it.")
    return Conclusion(Verdict.RANK_DIED, f.left, CulpritBasis.EXITED, Certainty.DEFINITE, summary,
                      Advice("A rank that leaves early leaves the others waiting in the next "
                             "collective: make every rank run the same steps (e.g. the same "
                             "number of batches: DistributedSampler(drop_last=True), or agree "
                             "to stop with an all_reduce of a 'done' flag)."))


def agent_died(f: Facts) -> Conclusion:
    w = waits_text(f, f.reports(None))
    summary = (f"The launcher (torchrun agent) was {exit_desc(f.ev.agent_exit_code)}; "
               f"{who(f.alive)} {agree(f.alive, 'was', 'were')} left orphaned"
               + (" and still running" if f.orphans_moving else "")
               + (f" ({'when captured' if f.orphans_moving else 'blocked'}: {w})" if w else "")
               + ". moe-hang ended them.")
    return Conclusion(Verdict.CRASH, [], CulpritBasis.NONE, Certainty.DEFINITE, summary,
                      Advice("Find out what ended the launcher (its process, not a rank, was "
                             "killed); the ranks had no error of their own."))


def barrier_laggards(f: Facts) -> dict[int, list[int]]:
    """Ranks whose monitored_barrier named the ranks that did not reach it in time."""
    return {r: lag for r, e in f.consequences.items()
            if (lag := monitored_barrier_laggards(e))}


def monitored_barrier(f: Facts) -> Conclusion:
    reporter, laggards = next(iter(sorted(barrier_laggards(f).items())))
    at = "; ".join(f"rank {r} was at {site_str(f.views[r].site)}" for r in laggards
                   if r in f.views)
    summary = (f"Rank {reporter}'s monitored_barrier reports that {who(laggards)} "
               "did not reach it in time" + (f" ({at})" if at else "") + ".")
    site = f.views[laggards[0]].site if laggards[0] in f.views else None
    return Conclusion(Verdict.HANG, laggards, CulpritBasis.WAITED_FOR, Certainty.LIKELY, summary,
                      Advice(f"Look at what rank {laggards[0]} does at {site_str(site)}: the "
                             "barrier waited for it there."))


def outside_when_failed(f: Facts) -> list[int]:
    """Ranks last seen outside any collective while the ones that failed (a timeout, a
    closed connection) were inside one: the others timed out waiting for them."""
    failed_in = [r for r in f.consequences if f.views[r].stack.state == RankState.IN_COLLECTIVE
                 or collective_of(f.consequences[r].frames)[0] is not None]
    if not failed_in:
        return []
    return sorted(r for r, v in f.views.items() if r not in f.consequences
                  and v.stack.state in (RankState.IDLE, RankState.COMPUTING))


def timed_out_waiting(f: Facts) -> Conclusion:
    culprits = outside_when_failed(f)
    where = "; ".join(f"rank {r} at {site_str(f.views[r].site)}" for r in culprits)
    failed = sorted(f.consequences)
    why = error_text(f.consequences[failed[0]], 120)
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.LIKELY,
                      f"{who(failed).capitalize()} failed waiting in a collective ({why}) for "
                      f"{who(culprits)}, which was outside any collective ({where}).",
                      Advice(f"Look at what rank {culprits[0]} does at "
                             f"{site_str(f.views[culprits[0]].site)}: the others waited for it "
                             "there until their timeout."))


def consequences_only(f: Facts) -> Conclusion:
    failed = sorted(f.bad_exit)
    why = next((error_text(f.consequences[r]) for r in failed if r in f.consequences), None)
    summary = (f"{who(failed).capitalize()} failed"
               + (f" with communication errors ({why[:120]})" if why else "")
               + ", and no rank raised an error of its own; the captures do not show which "
                 "collective diverged.")
    return Conclusion(Verdict.CRASH, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
                      Advice("Run it under `moe-hang watch` (or keep the Flight Recorder dumps: "
                             "TORCH_FR_BUFFER_SIZE) so the diverging collective is recorded."))


def restarted(rs: Restarts) -> tuple[str, Advice]:
    """torchrun restarted the worker group and the job then finished: "after 1 restart;
    attempt 0: rank 1 raised ValueError: … at x.py:9 load" — the failed attempt's root cause
    as the crash rule would name it (its earliest exception that is not a peer's consequence),
    else its ranks' communication errors, else that nothing of it is on record."""
    n = rs.count
    after = f"after {n} restart{'s' if n > 1 else ''}"
    errs = rs.errors
    roots = {r: e for r, e in errs.items()
             if not is_consequence(e) and not is_mismatch_report(e)}
    if not errs:
        return after + "; the failed attempt left no exception on record", Advice("")
    attempt = next(iter(errs.values())).restart
    label = f"attempt {attempt}" if attempt is not None else "the failed attempt"
    if not roots:
        failed = sorted(errs)
        return (f"{after}; {label}: {who(failed)} failed with communication errors "
                f"({error_text(errs[failed[0]], 80)})"), Advice("")
    timed = all(e.time is not None for e in roots.values())
    first = min(roots, key=lambda r: (roots[r].time or 0.0, r)) if timed or len(roots) == 1 \
        else None
    if first is None:
        ranks = sorted(roots)
        return (f"{after}; {label}: {who(ranks)} raised errors of their own ("
                + "; ".join(f"rank {r}: {error_text(roots[r], 80)}" for r in ranks) + ")"), \
            Advice("Fix each of these errors: torchrun restarted the job around them.")
    err = roots[first]
    site = callsite(err.frames)
    at = f" at {site.short()}" if site else ""
    return (f"{after}; {label}: rank {first} raised {error_text(err)}{at}",
            Advice(f"torchrun restarted the ranks after the {err.type.rsplit('.', 1)[-1]} rank "
                   f"{first} raised{at} in {label}: fix it, or each time it recurs costs a "
                   "restart (and ends the job once --max-restarts are used up)."))
