"""Verdicts from Flight Recorder dumps alone (``analyze`` on torch's dump files): each rank
alive and stuck when it dumped, with no stack. A rank with nothing pending in its dump was
outside every collective the recorder saw; where exactly, only a stack would say. Pure."""

from __future__ import annotations

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import (
    Certainty,
    CulpritBasis,
    Divergence,
    Verdict,
    pg_label,
)
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.rankstate import recorder_only
from moe_hang.evidence.vocab import RankState, spans


def outside_recorded(f: Facts, culprits: list[int], w: str, div: Divergence | None
                      ) -> Conclusion:
    """Post-mortem: the dumps say the others wait for these ranks and that these had nothing
    pending; where they were instead, only a stack would say (a send/recv gloo does not
    record, a data loader, a sleep)."""
    gloo = all((fr := f.views[r].ev.fr) is not None and fr.backend == "gloo" for r in culprits)
    never = (f" (it never posted {pg_label(div.pg, div.pg_desc)}#{div.seq})"
             if div is not None and div.seq else "")
    they = w or "the others"
    summary = (f"Rank {spans(culprits)} had no collective pending when the dumps were written "
               "(outside every collective the recorder saw"
               + ("; gloo records no send/recv" if gloo else "") + f"); {they} "
               f"wait{'s' if they.count('rank') == 1 else ''} for it{never}.")
    return Conclusion(Verdict.HANG, culprits, CulpritBasis.WAITED_FOR, Certainty.UNCERTAIN,
                      summary,
                      Advice(f"Rank {culprits[0]}'s stack while the job hangs says where it is "
                             "instead: `moe-hang diagnose` on the running job (or `py-spy dump "
                             "--pid PID`)."),
                      div)


def nothing_pending(f: Facts) -> bool:
    """Post-mortem dumps in which no rank waits in any collective."""
    return bool(f.alive) and all(recorder_only(f.views[r].ev)
                                 and f.views[r].state == RankState.IDLE for r in f.alive)


def all_completed(f: Facts) -> Conclusion:
    n = len(f.alive)
    # gloo retires a collective that raised as it does one that completed
    gloo = any((fr := f.views[r].ev.fr) is not None and fr.backend == "gloo" for r in f.alive)
    said = (f"Every collective in the {n} dumps finished (completed, or failed: gloo retires "
            "both alike): no rank was waiting in one when they were written. Whether the last "
            "ones failed (a mismatch gloo aborted) the dumps cannot say; the job's log can. "
            if gloo else f"Every collective in the {n} dumps completed: no rank was waiting "
            "in one when they were written, so they show no desync. ")
    return Conclusion(Verdict.INCONCLUSIVE, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
                      said + "If the job hung, it hung outside collectives (or after the "
                      "dumps); each rank's stack would say where.",
                      Advice("Take stacks while it hangs (`moe-hang diagnose`, or `py-spy dump "
                             "--pid PID` per rank)."))
