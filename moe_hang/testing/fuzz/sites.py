"""The records a job shape is made of: a :class:`Site` (one statement of a training step and
the collectives it posts) and a :class:`Family` (the model, its process groups and the sites
of one step), with the statements every family shares (the batch, the user's own logging).

A site's source uses placeholders that :mod:`.render` fills in: ``{n}`` (its number of
elements), ``{dt}`` (its dtype), ``{group}`` (the group it is posted on), ``{skip}`` (the
module a forward skips); the line that posts the collective ends in ``# corpus: <name>``.
What a site posts is given per rank (``events``), so the simulator and the ground truth
follow the same code the job runs. In the ``plain`` layout no two different collectives a
rank may meet have the same op and bytes; the other layouts (:mod:`.shapes`) have such
collectives on purpose, and gloo pairs them by op and bytes, whichever line posted them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from moe_hang.testing.fuzz.events import Coll, Event, GroupKey

EventsFn = Callable[[int, int], tuple[Event, ...]]  # (rank, world) -> what it posts
SkipStyle = Literal["wrap", "continue", "module"]
# an FSDP unit's all-gather in forward order: (tag, marker, ident)
Unit = tuple[str, str, str]
# groups of every rank: the default one, the logger's, the metrics thread's
EVERY_RANK = ("world", "log", "thread")


@dataclass(frozen=True)
class Site:
    """One statement (or a few) of a training step."""

    name: str
    lines: tuple[str, ...]
    events: EventsFn
    user: bool = True  # the user's own call: a fault can be planted on it
    skip: SkipStyle | None = "wrap"
    size: tuple[int, int] | None = None  # {n}: as written, as planted
    dtype: bool = False  # {dt}
    alt: tuple[str, str] | None = None  # the other op: (op, source line)
    swap_next: bool = False  # may be posted after the next site instead
    group_var: bool = False  # {group}: dp, or tp where planted
    send: bool = False
    runs_on: Callable[[int, int], bool] = field(default=lambda rank, world: True)
    # skip style "module": the planted line(s) that make the forward skip module k, and
    # what the rank posts then
    module_skip: Callable[[int], tuple[str, ...]] | None = None
    modules: int = 0
    skip_events: Callable[[int, int, int], tuple[Event, ...]] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    world: int
    imports: tuple[str, ...]
    setup: str
    sites: tuple[Site, ...]
    mesh: tuple[int, int] | None = None  # (dp, tp) of a 2-D mesh
    experts: bool = False
    fsdp: bool = False  # FSDP2 (slower to start and to step: longer limits)
    # FSDP2: its units' all-gathers in forward order (``UNITS`` in the setup), and the
    # forward an evaluation runs on ``x_val`` (every unit called)
    units: tuple[Unit, ...] = ()
    eval_call: str = ""
    shape: str = "plain"  # the step's layout (:mod:`.shapes`)
    std: tuple[str, ...] = ()  # standard modules the layout imports
    epilogue: tuple[str, ...] = ()  # after the loop, before the final barrier

    def members(self, group: GroupKey, rank: int) -> tuple[int, ...]:
        if group in EVERY_RANK:
            return tuple(range(self.world))
        assert self.mesh is not None, group
        dp, tp = self.mesh
        row, col = divmod(rank, tp)
        if group == "tp":
            return tuple(row * tp + j for j in range(tp))
        if group == "dp":
            return tuple(i * tp + col for i in range(dp))
        raise ValueError(f"unknown group {group!r}")

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)


def one(ev: Event) -> EventsFn:
    return lambda rank, world: (ev,)


def coll(group: GroupKey, op: str, tag: str, marker: str) -> EventsFn:
    return one(Coll(group, op, tag, marker))


def nothing(rank: int, world: int) -> tuple[Event, ...]:
    return ()


# --- what every family ends its step with: the user's own logging -----------------------

TAIL: tuple[Site, ...] = (
    Site("stats", (
        "stats = torch.zeros({n}, dtype={dt})",
        "stats[0], stats[1] = loss.item(), float(step)",
        "dist.all_reduce(stats)  # corpus: stats",
    ), coll("world", "all_reduce", "f32x4", "stats"), size=(4, 6), dtype=True,
        alt=("broadcast", "dist.broadcast(stats, 0)"), swap_next=True),
    Site("metrics", (
        "mine = torch.full(({n},), float(RANK), dtype={dt})",
        "seen = torch.empty({n} * WORLD, dtype={dt})",
        "dist.all_gather_into_tensor(seen, mine, group=LOG)  # corpus: metrics",
    ), coll("log", "all_gather", "f32x3", "metrics"), size=(3, 5), dtype=True,
        alt=("barrier", "dist.barrier(group=LOG)")),
    Site("stop", (
        "stop = torch.tensor([float(step == STEPS - 1)])",
        "dist.broadcast(stop, 0)  # corpus: stop",
    ), coll("world", "broadcast", "f32x1", "stop"),
        alt=("all_reduce", "dist.all_reduce(stop)")),
)
TAIL_NAMES = frozenset(s.name for s in TAIL)

LOG_SETUP = "LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger"


def code(name: str, *lines: str, skip: SkipStyle | None = None) -> Site:
    """Statements that post nothing (``skip='continue'``: a step may be skipped here)."""
    return Site(name, lines, nothing, user=False, skip=skip)


def batch_site() -> Site:
    return code("batch", "x, y = batch(step)", skip="continue")
