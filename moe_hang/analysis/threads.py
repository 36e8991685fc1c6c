"""Two threads of each rank posting on one group (docs/DESIGN.md §8): a group's collectives
pair by their order on each rank, and where a training loop and a helper thread (a logger,
an async checkpoint) both post on it, that order is each rank's timing. The first seq where
the members disagree, posted by different threads on different ranks, where every member's
agreed history already shows both threads on that group, is no rank's deviation: each rank
ran its own program, and the interleaving differs. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.align import GroupDivergence
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import OS_THREAD_NAMES, Frame, callsite, thread_number


@dataclass(frozen=True)
class ThreadRace:
    div: GroupDivergence  # the group's first divergence (sizes differ there)
    seq: int  # where the members' threads first differ (at or before the divergence)
    roles: dict[int, str]  # the thread that posted each member's collective at ``seq``
    colls: dict[int, Collective]  # and the collective
    sites: dict[str, Frame | None]  # each thread, a line it posts on the group from


def _role(c: Collective, main: str | None) -> str | None:
    """The posting thread, comparable across ranks: its Python name, else main or not."""
    if c.thread_name and c.thread_name not in OS_THREAD_NAMES:
        return c.thread_name
    if c.thread_id is None or main is None:
        return None
    same = thread_number(c.thread_id) == thread_number(main)
    return "MainThread" if same else "a helper thread"


def thread_race(divs: list[GroupDivergence], views: RankViews) -> ThreadRace | None:
    """The earliest divergence that two threads' interleaving on one group explains: from
    the first seq where the members' collectives came from different threads (gloo pairs
    equal sizes silently, so that may be before the divergence), every member's records
    showing both threads on the group (:func:`_shared`), each thread's own collectives alike
    across the members and no loop counter setting them apart."""
    main = {r: v.ev.heartbeat.main_thread if v.ev.heartbeat is not None else None
            for r, v in views.items()}
    for g in divs:
        end, ranks = g.div.seq, sorted(g.have)
        if end is None or g.absent or len(ranks) < 2:
            continue
        slots = {r: views[r].tl.by_pg.get(g.div.pg, {}) for r in ranks}
        first = slots[ranks[0]]
        # one rank's history on the group from one thread only: no race (and no scan)
        if len({_role(c, main.get(ranks[0])) for c in first.values()} - {None}) < 2:
            continue
        for seq in sorted(s for s in first if s <= end):
            colls = {r: slots[r].get(seq) for r in ranks}
            if any(c is None for c in colls.values()):
                continue
            roles = {r: _role(c, main.get(r)) for r, c in colls.items() if c is not None}
            named = {n for n in roles.values() if n is not None}
            if len(named) < 2:
                continue
            if None in roles.values():
                break
            sites = _shared(slots, main, named)
            if sites is not None and _each_thread_agrees(slots, main, named) \
                    and _same_laps(views, ranks):
                return ThreadRace(g, seq, {r: str(n) for r, n in roles.items()},
                                  {r: c for r, c in colls.items() if c is not None}, sites)
            break
    return None


def _shared(slots: dict[int, dict[int, Collective]], main: dict[int, str | None],
            named: set[str]) -> dict[str, Frame | None] | None:
    """Each thread's line on the group, where every member posted on it from every one of
    ``named`` (the first time may be ``seq`` itself, or just after it: each rank's first
    post of the helper is where their orders first part); None where one did not — a
    thread one rank alone has posts its extras, no race."""
    sites: dict[str, Frame | None] = {}
    for r, slot in slots.items():
        seen: dict[str, Frame | None] = {}
        for c in slot.values():
            if (role := _role(c, main.get(r))) is not None and seen.get(role) is None:
                seen[role] = callsite(c.frames)
        if not named <= set(seen):
            return None
        for n in named:
            if sites.get(n) is None:
                sites[n] = seen[n]
    return sites


def _each_thread_agrees(slots: dict[int, dict[int, Collective]], main: dict[int, str | None],
                        named: set[str]) -> bool:
    """Each thread's own collectives on the group, in order, alike on every member (one a
    prefix of another: ranks are at different points): only their merge differs. A rank
    whose thread lacks one the others' posted skipped it — no race explains that."""
    for n in named:
        seqs = [[(c.op, c.input_sizes) for _, c in sorted(slot.items())
                 if _role(c, main.get(r)) == n] for r, slot in slots.items()]
        for a in seqs[1:]:
            k = min(len(a), len(seqs[0]))
            if a[:k] != seqs[0][:k]:
                return False
    return True


def _same_laps(views: RankViews, ranks: list[int]) -> bool:
    """No loop counter (py-spy's locals) of a function every one of ``ranks`` is in differs:
    a rank a lap on went past a collective, whatever the threads did."""
    seen: dict[tuple[str, str, str], int] = {}
    for r in ranks:
        for f, names in views[r].stack.counters.items():
            for name, value in names.items():
                if seen.setdefault((f.file, f.function, name), value) != value:
                    return False
    return True
