"""What is not known is not blamed (docs/DESIGN.md §10): a job that spans nodes, some of
whose watchers never answered. Their ranks are *unreached*: never a culprit. A verdict about
the known ranks stands when it rests on them alone — a group whose members are all known
disagrees, a known rank raised, died or left, a known rank still moves, or one waits on known
ranks only; otherwise the known ranks only wait, and for whom is the verdict (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.conclusion import Conclusion
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, RankReport, Verdict, pg_label
from moe_hang.analysis.explain import error_text
from moe_hang.analysis.facts import Facts
from moe_hang.evidence.flight_recorder import DEFAULT_PG
from moe_hang.evidence.model import Unreached
from moe_hang.evidence.vocab import RankState, agree, spans, who


def _members(f: Facts, pg: str) -> set[int]:
    """A group's members as far as known: the probes' group lists, the recorders', every rank
    that posted in it; the default group has every rank of the world."""
    out: set[int] = set()
    for r, v in f.views.items():
        out.update((v.ev.groups or {}).get(pg, []))
        if v.ev.fr is not None:
            out.update(v.ev.fr.pg_ranks.get(pg, []))
        if pg in v.tl.by_pg:
            out.add(r)
    if pg == DEFAULT_PG and f.ev.world_size:
        out.update(range(f.ev.world_size))
    return out


def waits_on_unreached(f: Facts) -> dict[tuple[str, str, int | None], list[int]]:
    """``(op, pg, seq) -> the known ranks waiting in it`` when every known rank that waits in
    a collective waits on a group with unreached members and nothing about the known ranks
    alone decides; empty when a verdict about the known ranks stands."""
    un = f.ev.unreached
    if un is None or not un.ranks or f.moving:
        return {}
    known = set(f.views)
    if any(g.div.members and set(g.div.members) <= known for g in f.divs):
        return {}  # a fully observed group disagrees: a fact, whatever the rest does
    waits: dict[tuple[str, str, int | None], list[int]] = {}
    for r in f.waiting:
        key = _waits_in(f, r)
        if key is None:
            continue
        group = _members(f, key[1]) if key[1] != "?" else set()
        if group and group <= known:
            return {}  # it waits for known ranks only: the verdict is about known ranks
        waits.setdefault(key, []).append(r)
    return waits


def _waits_in(f: Facts, r: int) -> tuple[str, str, int | None] | None:
    """(op, group, seq) of the collective a rank waits in; the group is ``?`` when only its
    stack says it is in one (no recorder: its members are not known)."""
    v = f.views[r]
    if v.state != RankState.IN_COLLECTIVE:
        return None
    if v.current is not None:
        return (v.current.op, v.current.pg, v.current.seq)
    return (v.stack.op, "?", None) if v.stack.op else None


def _where(ranks: Sequence[int], un: Unreached, most: int = 4) -> str:
    """"on node vm-1" (the host when known, else the node's number); many: the first few."""
    if not un.local_world:
        return "on other nodes"
    nodes = sorted({r // un.local_world for r in ranks})
    word = "on node " if len(nodes) == 1 else "on nodes "
    if not any(str(n) in un.hosts for n in nodes):
        return word + spans(nodes)
    names = [un.hosts.get(str(n)) or str(n) for n in nodes]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return word + ", ".join(names[:most]) + more


def waiting_on_unreached(f: Facts) -> Conclusion:
    un = f.ev.unreached
    assert un is not None
    parts = []
    for (op, pg, seq), rs in sorted(waits_on_unreached(f).items(), key=lambda kv: kv[1]):
        c = f.views[rs[0]].current
        where = (f"{op} {pg_label(pg, c.pg_desc if c else '', word='pg')}"
                 + (f"#{seq}" if seq is not None else "")) if pg != "?" else op
        them = (sorted(_members(f, pg) & set(un.ranks)) if pg != "?" else []) or sorted(un.ranks)
        parts.append(f"{who(rs)} {agree(rs, 'waits', 'wait')} in {where} for {who(them)} "
                     f"{_where(them, un)}")
    where = _where(sorted(un.ranks), un)
    if un.not_given:
        text = "; ".join(parts) + ": `moe-hang analyze` their node's capture with this one"
        return Conclusion(
            Verdict.HANG, [], CulpritBasis.NONE, Certainty.UNCERTAIN,
            text[:1].upper() + text[1:],
            Advice(f"Nothing here is to blame: the ranks wait for others whose capture is not "
                   f"among those given. Analyze the run directory {where} with this one (or "
                   "the run directory of the node that analysed: it keeps every node's)."))
    text = "; ".join(parts) + ": run moe-hang there, or `moe-hang analyze` both captures"
    return Conclusion(
        Verdict.HANG, [], CulpritBasis.NONE, Certainty.UNCERTAIN, text[:1].upper() + text[1:],
        Advice(f"Nothing here is to blame: the ranks wait for others whose watcher did not "
               f"answer. Run `moe-hang diagnose` {where} (or `moe-hang watch` there), then "
               "`moe-hang analyze` the captures together."))


def failed_with_unknowns(f: Facts) -> bool:
    """Known ranks failed, none of an error of its own, and ranks of other nodes are unknown:
    the root cause may be theirs."""
    un = f.ev.unreached
    return bool(f.bad_exit) and un is not None and bool(un.ranks)


def failed_elsewhere(f: Facts) -> Conclusion:
    """The ranks here only failed as a consequence (a peer closed its connection); the ranks
    that could have raised are on nodes nothing was heard from: never "no rank raised"."""
    un = f.ev.unreached
    assert un is not None
    failed = sorted(f.bad_exit)
    why = next((error_text(f.consequences[r], 120) for r in failed if r in f.consequences),
               None)
    where = _where(sorted(un.ranks), un)
    one = where.startswith("on node ")
    summary = (f"{who(failed).capitalize()} failed"
               + (f" with communication errors ({why})" if why else "")
               + f", and {'it raised no' if len(failed) == 1 else 'none of them raised an'} "
               f"error of its own; {who(un.ranks)} {where} {agree(un.ranks, 'is', 'are')} "
               f"unknown ({_unknown_why(un, one)}): the cause is "
               f"there (a rank that raised, died or was killed) or between the nodes.")
    at = where.replace("on ", "at ", 1)
    return Conclusion(
        Verdict.CRASH, [], CulpritBasis.NONE, Certainty.UNCERTAIN, summary,
        Advice(f"Look {at}: the verdict {'its watcher' if one else 'their watchers'} printed, "
               f"{'its job log' if one else 'their job logs'}, or `moe-hang analyze` "
               f"{'its run directory' if one else 'their run directories'} together with "
               "this one."))


def unreached_reports(un: Unreached | None, have: set[int]) -> list[RankReport]:
    """One report per unreached rank (state unknown, where it runs)."""
    if un is None:
        return []
    out = []
    for r in sorted(set(un.ranks) - have):
        node = str(r // un.local_world) if un.local_world else "?"
        why = "not in the captures given" if un.not_given else "no watcher answered"
        out.append(RankReport(rank=r, host=un.hosts.get(node), state=RankState.UNKNOWN,
                              note=f"node {node}: {why}"))
    return out


def unreached_line(un: Unreached | None) -> list[str]:
    """The evidence line that says which ranks are unknown and why."""
    if un is None or not un.ranks:
        return []
    where = (_where(un.ranks, un).replace("on ", "of ", 1) if un.local_world
             else "of their nodes")
    if un.not_given:
        return [f"{who(un.ranks)} unknown: the capture {where} is not among those given"]
    return [f"{who(un.ranks)} unknown: no answer from the watcher {where}"]


def _unknown_why(un: Unreached, one: bool) -> str:
    if un.not_given:
        return f"not in the captures given: {'its' if one else 'their'} run director" \
            + ("y" if one else "ies") + " elsewhere"
    return f"no answer from the watcher{'' if one else 's'} there"
