"""A fault applied to a job's steps: the :class:`Plant` record (what, where, when, how), which
sites a kind can go on, and what every rank posts with it (the programs the simulator runs).
The source the job is written with comes from the same record (:mod:`.render`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_hang.testing.fuzz.catalogue import SHIFTS, Kind
from moe_hang.testing.fuzz.events import P2P, Coll, Event, Fork, Join, Stop
from moe_hang.testing.fuzz.shapes import THREAD
from moe_hang.testing.fuzz.sites import Family, Site

# the rank-only collective an ``extra`` plant posts: variant -> (group, op, tag)
EXTRA = {"eval": ("world", "all_reduce", "f32x3"),
         "checkpoint": ("world", "barrier", "barrier"),
         "histogram": ("log", "all_gather", "f32x5")}
EXCEPTIONS = {"value": "ValueError", "oom": "OutOfMemoryError", "runtime": "RuntimeError",
              "assert": "AssertionError"}
FINISH = Coll("world", "barrier", "barrier", "finish")


@dataclass(frozen=True)
class Plant:
    """One fault: ``kind`` planted on (or, for point kinds, before) site ``site`` at step
    ``step`` of ``steps``, on the culprit ranks only. ``variant``: skip (wrap, continue,
    module), extra (eval, checkpoint, histogram), exception (value, oom, runtime, assert);
    ``module``: the module a forward skips; ``seconds``: how long a healthy slow rank is
    slow. The kinds of :data:`.catalogue.SHIFTS` are a ``skip`` or an ``extra`` of their
    site; ``fsdp_eval`` an ``eval`` or a ``checkpoint`` after it."""

    kind: str
    site: str
    step: int
    steps: int
    variant: str = ""
    module: int = 0
    seconds: float = 0.0


def _allows(kind: Kind, site: Site, nxt: Site | None) -> bool:
    """Whether a site kind (other than skip and extra) can go on ``site``."""
    return {"size": site.size is not None,
            "dtype": site.dtype,
            "alt": site.alt is not None,
            "swap_next": site.swap_next and nxt is not None and nxt.user,
            "group_var": site.group_var,
            "send": site.send}.get(kind.needs, False)


def first_coll(site: Site) -> Coll | None:
    """The first collective ``site`` posts (as rank 0 of two: a user's site posts the same on
    every rank)."""
    return next((e for e in site.events(0, 2) if isinstance(e, Coll)), None)


def planted_group(family: Family, plant: Plant) -> str:
    """The group the planted site's collective is posted on."""
    c = first_coll(family.site(plant.site))
    return c.group if c is not None else "world"


def _shift_sites(family: Family, needs: str) -> list[Site]:
    """The user's sites a skip or an extra of kind ``needs`` goes on: ``twin``, those whose
    collective has the op and bytes of the next one its group meets in the step (gloo pairs
    the one that is left silently); ``last``, the step's last collective; ``nowait``, those
    posted with async_op; ``thread``, those a background thread posts."""
    colls = [(s, c) for s in family.sites if (c := first_coll(s)) is not None]
    out = []
    for i, (s, c) in enumerate(colls):
        nxt = next((d for _, d in colls[i + 1:] if d.group == c.group), None)
        if not s.user or s.skip != "wrap":
            continue
        if (needs == "twin" and nxt is not None and (nxt.op, nxt.tag) == (c.op, c.tag)) or \
                (needs == "last" and i == len(colls) - 1) or \
                (needs == "nowait" and c.nowait) or (needs == "thread" and c.thread):
            out.append(s)
    return out


def eligible_sites(family: Family, kind: Kind) -> list[tuple[Site, str]]:
    """(site, variant) pairs ``kind`` can be planted on in ``family``."""
    sites = list(family.sites)
    if kind.name in SHIFTS:
        return [(s, v) for s in _shift_sites(family, kind.needs) for v in ("skip", "extra")]
    if kind.needs == "units":  # between two steps: after the step's last statement
        return [(sites[-1], v) for v in ("eval", "checkpoint")] if family.units else []
    out: list[tuple[Site, str]] = []
    for i, s in enumerate(sites):
        nxt = sites[i + 1] if i + 1 < len(sites) else None
        if kind.target == "point":
            out.append((s, ""))
        elif kind.needs == "skip":
            if s.skip == "continue":
                out.append((s, "continue"))
            elif s.skip == "module":
                out.append((s, "module"))
            elif s.user and s.skip == "wrap" and not s.send:
                out.append((s, "wrap"))
        elif kind.needs == "extra":
            if s.user:
                out.extend((s, v) for v in EXTRA)
        elif _allows(kind, s, nxt):
            out.append((s, ""))
    return out


def _retagged(evs: tuple[Event, ...], old: str, new: str) -> tuple[Event, ...]:
    return tuple(replace(e, tag=e.tag.replace(old, new)) if isinstance(e, Coll) else e
                 for e in evs)


def _renamed(evs: tuple[Event, ...], marker: str) -> tuple[Event, ...]:
    return tuple(replace(e, marker=marker) if isinstance(e, (Coll, P2P)) else e for e in evs)


def _planted_site(family: Family, site: Site, plant: Plant, rank: int, world: int
                  ) -> tuple[Event, ...]:
    """What ``site`` posts on a culprit at the fault step (site kinds only)."""
    evs = site.events(rank, world)
    k = plant.kind
    if k in SHIFTS:
        if plant.variant == "skip":
            return ()
        first = evs[0]
        assert isinstance(first, Coll)
        # a rank-only call of the same op and size; a thread posts it from its own line
        return (*evs, first if first.thread else replace(first, marker="extra"))
    if k == "fsdp_eval":  # a forward (or unshard) of every unit, in order, from its line
        return (*evs, *(Coll("world", "all_gather", tag, plant.variant, ident)
                        for tag, _, ident in family.units))
    if k in ("skip", "recv_no_send"):
        if plant.variant == "module":
            assert site.skip_events is not None
            return site.skip_events(rank, world, plant.module)
        return ()
    if k == "extra":
        group, op, tag = EXTRA[plant.variant]
        return (*evs, Coll(group, op, tag, "extra"))
    if k == "size":
        assert site.size is not None
        return _retagged(evs, f"x{site.size[0]}", f"x{site.size[1]}")
    if k == "dtype":
        return _retagged(evs, "f32", "f64")
    if k == "op_swap":
        assert site.alt is not None
        op = site.alt[0]
        return tuple(Coll(e.group, op, "barrier" if op == "barrier" else e.tag, "swapped")
                     for e in evs if isinstance(e, Coll))
    if k == "wrong_group":
        return tuple(replace(e, group="tp") if isinstance(e, Coll) else e for e in evs)
    raise ValueError(f"{k} is not planted on a site")


STOPS = {"exception": Stop("raise", "raise"), "early_exit": Stop("exit", None),
         "sigkill": Stop("kill", None), "lock": Stop("block", "lock")}


def step_events(family: Family, plant: Plant | None, rank: int) -> tuple[list[Event], bool]:
    """What ``rank`` posts in one step (``plant``: this rank is a culprit at the fault step),
    and whether it stopped there."""
    out: list[Event] = []
    sites = family.sites
    world = family.world
    j = 0
    while j < len(sites):
        s = sites[j]
        if plant is None or s.name != plant.site:
            out.extend(s.events(rank, world))
            j += 1
            continue
        if plant.kind in STOPS:
            out.append(STOPS[plant.kind])
            return out, True
        if plant.kind in ("sleep", "busy"):
            out.extend(s.events(rank, world))
        elif plant.kind == "skip" and plant.variant == "continue":
            return out, False  # the rest of the step is skipped
        elif plant.kind == "order_swap":
            nxt = sites[j + 1]
            out.extend(_renamed(nxt.events(rank, world), "swapped"))
            out.extend(_renamed(s.events(rank, world), "swapped_then"))
            j += 1
        else:
            out.extend(_planted_site(family, s, plant, rank, world))
        j += 1
    return out, False


def _threaded(prog: list[Event]) -> list[Event]:
    """The collectives a background thread posts moved to its own program, started first;
    the main thread joins it before the final barrier."""
    mine = tuple(e for e in prog if isinstance(e, Coll) and e.thread)
    main = [e for e in prog if not (isinstance(e, Coll) and e.thread)]
    if main and main[-1] == FINISH:
        main[-1:] = [Join(THREAD, "join"), FINISH]
    return [Fork(THREAD, mine), *main]


def programs(family: Family, plant: Plant, culprits: frozenset[int]) -> list[list[Event]]:
    """Every rank's whole run: the steps, then the final barrier (a layout with a metrics
    thread: started first, joined before it)."""
    progs: list[list[Event]] = []
    for rank in range(family.world):
        prog: list[Event] = []
        stopped = False
        for step in range(plant.steps):
            faulty = rank in culprits and step == plant.step
            evs, stopped = step_events(family, plant if faulty else None, rank)
            prog.extend(evs)
            if stopped:
                break
        if not stopped:
            prog.append(FINISH)
        progs.append(_threaded(prog) if family.shape == "thread" else prog)
    return progs
