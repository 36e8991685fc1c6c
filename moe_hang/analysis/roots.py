"""A rooted collective whose members name different roots (docs/DESIGN.md §8): a broadcast
whose ``src`` one rank computed as another rank than the others did never completes — every
member must name the same root, the one that sends (or receives, for a reduce or gather).
Read from the c10d frame's arguments on the stacks (py-spy ``--locals``); the recorder keeps
no root, so its entries match. Who deviates: the ranks whose root a strict majority does not
name (the ladder's majority rung); without one, every camp is named. Pure."""

from __future__ import annotations

from dataclasses import replace

from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, Verdict, pg_label
from moe_hang.analysis.explain import site_str
from moe_hang.analysis.facts import Facts
from moe_hang.analysis.ladder import COUNTS_ONLY, decide
from moe_hang.analysis.readings import camp_readings
from moe_hang.analysis.situation import Advice
from moe_hang.analysis.source import on_default_group
from moe_hang.analysis.timeline import RankView
from moe_hang.evidence.calls import ROOTED_FUNCS, RootedCall
from moe_hang.evidence.vocab import agree, who


def root_camps(f: Facts) -> dict[str, list[int]] | None:
    """Root (``src=1``) -> the live ranks naming it, where the live ranks inside a rooted
    collective are in one call of it — one op, one group (the recorders' name; stacks alone:
    the default group), one position and one pass by their loop counters (an object
    broadcast posts two collectives: its ranks may be one apart) — and name more than one
    root; else None."""
    rooted = {r: c for r in sorted(f.alive) if (c := f.views[r].stack.root) is not None}
    inside, calls = {r: f.views[r] for r in rooted}, list(rooted.values())
    groups = {v.current.pg if v.current is not None else None for v in inside.values()}
    spots = {(tuple(v.position), tuple(sorted((k.line, tuple(sorted(c.items())))
                                              for k, c in v.stack.counters.items())))
             for v in inside.values()}
    if len(inside) < 2 or len({c.op for c in calls}) != 1 or len(groups) != 1 \
            or len(spots) != 1 or (groups == {None} and not _default(f, inside, calls)):
        return None
    camps: dict[str, list[int]] = {}
    for r, c in zip(inside, calls, strict=True):
        camps.setdefault(f"{c.arg}={c.root}", []).append(r)
    return camps if len(camps) > 1 else None


def _default(f: Facts, inside: dict[int, RankView], calls: list[RootedCall]) -> bool:
    """Stacks alone: the call is on the default group — its ``group`` argument is None, or
    the source shows the job's line passes no ``group=``."""
    sites = {v.stack.callsite for v in inside.values()}
    site = sites.pop() if len(sites) == 1 else None
    return all(c.default_group for c in calls) or (
        site is not None and on_default_group(f.views.source, site.file, site.line) is True)


def roots_differ(f: Facts) -> Conclusion:
    camps = root_camps(f)
    assert camps is not None
    ranks = sorted(r for rs in camps.values() for r in rs)
    first = f.views[ranks[0]]
    op = first.stack.root.op if first.stack.root is not None else "collective"
    arg = ROOTED_FUNCS.get(op, "root")
    c = first.current
    on = f" on {pg_label(c.pg, c.pg_desc)}" if c is not None else ""
    sites = {f.views[r].stack.callsite for r in ranks}
    at = f" at {site_str(s)}" if len(sites) == 1 and (s := sites.pop()) is not None else ""
    named = "; ".join(f"{who(rs)} {root}" for root, rs in sorted(
        camps.items(), key=lambda kv: (-len(kv[1]), kv[1])))
    # the camps' readings, to the one ladder: one call, one line, one pass — no history,
    # source or order tells the roots apart, only how many name each
    d = decide([replace(x, given=COUNTS_ONLY) for x in camp_readings(
        c.pg if c is not None else "", None, list(camps.values()), {}, f.views)], f.ctx)
    culprits, basis, certainty = (d.culprits if d.reading is not None else ranks), d.basis, \
        Certainty.LIKELY
    if d.reading is not None:
        top = list(d.reading.others)
        blame = (f" {who(culprits).capitalize()} {agree(culprits, 'names', 'name')} another "
                 f"{arg} than {who(top)}.")
    else:
        blame = (" No root has a majority: which side computed it wrong, these stacks do not "
                 "say (each rank's own inputs to it would).")
    summary = (f"Ranks wait in one {op}{on}{at} naming different roots ({named}): it never "
               f"completes, every member must pass the same {arg}.{blame}")
    return Conclusion(
        Verdict.DESYNC, culprits, basis, certainty, summary,
        Advice(f"Every rank must pass {op} the same {arg} ({named}): where the root is "
               "computed from a rank's own data (its scores, its loss), compute it from "
               "values every rank shares (all-reduce them first), or decide it on one fixed "
               "rank and broadcast the decision from there."))
