"""What is not known is not blamed: a verdict that would blame known ranks for waiting on the
ranks of nodes whose watcher never answered becomes a sentence saying whom they wait for and
where to look (:func:`guard_unknown`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from moe_hang.analysis.diagnosis import (
    NO_PROBLEM,
    Certainty,
    CulpritBasis,
    Diagnosis,
    RankReport,
    Verdict,
    pg_label,
)
from moe_hang.analysis.ranktext import spans
from moe_hang.evidence.flight_recorder import DEFAULT_PG
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Evidence
from moe_hang.evidence.vocab import RankState
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime.monitor import Outcome, world_of


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
