"""The advice where FSDP's collectives set the sides apart (docs/DESIGN.md §8, advice): the
culprits all-gathered in their backward where the others reduced gradients (their gradient
sync was off), or they are still at an earlier line than the module call whose all-gather
the others completed with another collective of theirs. Pure."""

from __future__ import annotations

from moe_hang.analysis.situation import Advice, Situation, at_line, collective_of_ranks
from moe_hang.evidence.vocab import agree, who


def advise_fsdp_sync(s: Situation) -> Advice:
    """The culprits all-gathered parameters in their backward where the others reduced
    gradients: their sync was off there, or the module was not in their forward."""
    me, others, called = who(s.culprits), who(s.waiting()), s.waited_site()
    return Advice(
        f"{others.capitalize()} reduced gradients (after the backward at {at_line(called)}) "
        f"where {me} all-gathered parameters in {agree(s.culprits, 'its', 'their')} "
        "backward instead: FSDP reduces a module's gradients only where gradient sync is on "
        "(`set_requires_gradient_sync`, `no_sync`) and the module ran in the forward. So on "
        f"{me} sync was off — a micro-batch not {agree(s.culprits, 'its', 'their')} last "
        f"while it was theirs: more micro-batches this step (a count from its own data: "
        "packing by tokens, a ragged last batch) or sync on another one — or that module "
        "was not called. Give every rank the same number of micro-batches (all-reduce the "
        "count with MAX first, pad with empty ones) with sync on the same one, and call the "
        "same modules on every rank.")


def advise_behind(s: Situation) -> Advice:
    """The culprits are still at an earlier line of the iteration than the module call the
    others are in: they never got to it, so nothing there was skipped. The others completed
    the collective the culprits wait in with another of theirs of the same size (gloo pairs
    equal sizes silently): the culprits posted one more before it."""
    culprit = s.culprits[0]
    rep = s.reports.get(culprit)
    now = at_line(rep.callsite) if rep is not None and rep.callsite is not None \
        else collective_of_ranks(s, [culprit])
    op = rep.collective.op if rep is not None and rep.collective is not None else "collective"
    called = s.waited_site()
    there = f" (at {at_line(called)}, a module's FSDP all-gather)" if called else ""
    return Advice(f"{who(s.culprits).capitalize()} {agree(s.culprits, 'is', 'are')} still in "
                  f"the {op} at {now}, which {who(s.waiting())} went past{there}: they "
                  f"completed theirs with another of {who(s.culprits)}'s collectives of the "
                  "same size (gloo pairs equal sizes silently), so "
                  f"{who(s.culprits)} posted one more before it than they did (a rank-only "
                  "extra: a logging all-reduce, an evaluation). Post the same collectives on "
                  "every rank; `moe-hang watch` (Flight Recorder) shows which one.")
