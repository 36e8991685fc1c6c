"""Seeded choices: for job ``i`` of seed ``S`` (its own ``random.Random(f"{S}:{i}")``, so a job
does not change when N does), the fault kind (each block of ``len(KINDS)`` jobs draws every
kind once, in an order of its own: N runs see each kind about N / 2 / len(KINDS) times), the
family and its step layout, the world size (2-8, weighted towards 2-4 on a small machine),
the site and step, the culprits and their mirror, the launch (one torchrun, or two torchrun
agents as two nodes each under its own watch), the mode (watch, or diagnose attached to the
job in the background) and, from streams of their own, whether a busy neighbour burns a core
beside the job and whether the job's Flight Recorder keeps no call stacks. A draw whose outcome
the simulator cannot predict, or whose fault would not show (an order swap that still
completes), is drawn again."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import moe_hang.testing.fuzz.catalogue as catalogue
import moe_hang.testing.fuzz.families as families
from moe_hang.testing.fuzz.catalogue import Kind
from moe_hang.testing.fuzz.plant import EXCEPTIONS, Plant, eligible_sites
from moe_hang.testing.fuzz.sites import Family
from moe_hang.testing.fuzz.truth import SHIFTED, RoleTruth, Truth, truth, visible_at

Launch = Literal["torchrun", "two_nodes"]
Mode = Literal["watch", "diagnose"]
WORLD_WEIGHTS = {2: 4, 3: 2, 4: 3, 6: 1, 8: 1}
TWO_NODES_P = 0.25
DIAGNOSE_P = 0.3
# a share of the runs have a CPU-burning neighbour on the same cores (a shared node): one
# job in every NEIGHBOUR_EVERY, so that any N has a third of them
NEIGHBOUR_EVERY = 3
# a share of the watched runs record no call stacks (``MOE_HANG_FR_STACKS=0``, as a job that
# sets TORCH_FR_DUMP_TEMP_FILE itself, or whose dumps do not answer beside a busy neighbour,
# has only the probe's saves): one job in every STACKLESS_EVERY
STACKLESS_EVERY = 4
# kinds whose culprit and victims stand in exclusive branches (if / else, or an extra call
# against none), or at lines a shift of gloo's pairing put them (line order says nothing
# there): stacks alone (diagnose, no recorder history) tell them apart by a majority only,
# which two ranks do not have
EXCLUSIVE = ("op_swap", "order_swap", "extra", *SHIFTED)
# a skipped FSDP module or expert (the bug this tool is for), a skipped step (uneven
# iterations), a skipped call
SKIP_WEIGHTS = {"module": 2, "continue": 1, "wrap": 2}
MAX_TRIES = 200


@dataclass(frozen=True)
class JobSpec:
    """Everything drawn for one job (the job's source and truth follow from it)."""

    seed: int
    index: int
    kind: str
    family: str
    world: int
    mesh: tuple[int, int] | None
    launch: Launch
    mode: Mode
    plant: Plant
    culprits: tuple[int, ...]
    mirror: tuple[int, ...]  # () : no mirrored twin (no other rank can play the role)
    stall: float | None  # watch --stall (None: the tool's default)
    hang_after: float | None  # watch --hang-after (None: the tool's default)
    shape: str = "plain"  # the step's layout (shapes.py)
    neighbour: bool = False  # a CPU-burning process beside the job for its lifetime
    stackless: bool = False  # the recorder keeps no call stacks (MOE_HANG_FR_STACKS=0)

    @property
    def name(self) -> str:
        return f"fuzz{self.seed}_{self.index:03d}_{self.kind}_{self.family}"

    def build(self) -> Family:
        return families.build(self.family, self.world, self.mesh, self.shape)


def kind_of(seed: int, index: int) -> Kind:
    """Job ``index``'s fault kind: every block of ``len(KINDS)`` jobs of a seed has each kind
    once, in a shuffled order of its own."""
    block, pos = divmod(index, len(catalogue.KINDS))
    order = list(catalogue.KINDS)
    random.Random(f"{seed}:kinds:{block}").shuffle(order)
    return order[pos]


def neighbour_of(seed: int, index: int) -> bool:
    """Whether job ``index`` runs beside a busy neighbour: one job of each block of
    ``NEIGHBOUR_EVERY``, drawn from a stream of its own (the rest of the draw does not depend
    on it)."""
    block, pos = divmod(index, NEIGHBOUR_EVERY)
    return random.Random(f"{seed}:neighbour:{block}").randrange(NEIGHBOUR_EVERY) == pos


def stackless_of(seed: int, index: int) -> bool:
    """Whether job ``index``'s recorder keeps no call stacks: one job of each block of
    ``STACKLESS_EVERY``, from a stream of its own (the rest of the draw does not depend on
    it; a job attached to with ``diagnose`` has no recorder, and its draw says no)."""
    block, pos = divmod(index, STACKLESS_EVERY)
    return random.Random(f"{seed}:stackless:{block}").randrange(STACKLESS_EVERY) == pos


def _families_for(kind: Kind) -> list[str]:
    out = []
    for name in families.FAMILIES:
        world = min(families.worlds(name))
        mesh = (2, world // 2) if name == "mesh2d" else None
        if any(eligible_sites(families.build(name, world, mesh, shape), kind)
               for shape in kind.shapes):
            out.append(name)
    return out


def _world(rng: random.Random, family: str, launch_even: bool) -> int:
    allowed = [w for w in families.worlds(family) if not launch_even or w % 2 == 0]
    return rng.choices(allowed, weights=[WORLD_WEIGHTS[w] for w in allowed])[0]


def _culprits(rng: random.Random, fam: Family, kind: Kind, plant: Plant,
              two_nodes: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The culprits and their mirror (another rank; on the other node where there are two;
    a whole tensor-parallel row for a wrong group, half the time)."""
    world = fam.world
    site = fam.site(plant.site)
    ranks = [r for r in range(world) if site.runs_on(r, world)]
    if kind.name == "wrong_group" and fam.mesh is not None and rng.random() < 0.5:
        dp, tp = fam.mesh
        row = rng.randrange(dp)
        other = (row + 1) % dp
        return (tuple(row * tp + j for j in range(tp)),
                tuple(other * tp + j for j in range(tp)))
    c = rng.choice(ranks)
    prefer = (c + world // 2) % world if two_nodes else None
    choices = [r for r in ranks if r != c]
    if not choices:
        return (c,), ()  # no other rank can play the role: no twin
    m = prefer if prefer in choices else rng.choice(choices)
    return (c,), (m,)


def _plant(rng: random.Random, fam: Family, kind: Kind) -> Plant | None:
    options = eligible_sites(fam, kind)
    if not options:
        return None
    if kind.name == "skip":  # how a skip is written, then where
        ways = sorted({v for _, v in options})
        way = rng.choices(ways, weights=[SKIP_WEIGHTS[w] for w in ways])[0]
        options = [o for o in options if o[1] == way]
    site, variant = rng.choice(options)
    step = rng.choice((2, 3))
    module = 0
    if variant == "module":
        module = rng.randrange(site.modules)
    if kind.name == "exception":
        variant = rng.choice(sorted(EXCEPTIONS))
    seconds = 0.0
    if kind.name == "sleep":
        seconds = float(rng.choice((3, 5, 8, 12)))
    elif kind.name == "busy":
        seconds = float(rng.choice((3, 5, 8)))
    return Plant(kind.name, site.name, step, step + 2, variant, module, seconds)


def stacks_single_out(rt: RoleTruth) -> bool:
    """No culprit is at a line a rank that is not one is also at (ranks that stopped are
    at none): stacks alone can tell the culprits from the rest."""
    at = visible_at(rt.outcome, "diagnose")
    return not any(at.get(c) is not None and at.get(c) == m
                   for c in rt.culprits for r, m in at.items() if r not in rt.culprits)


def draw(seed: int, index: int) -> tuple[JobSpec, Truth]:
    """Job ``index`` of ``seed`` and its ground truth."""
    rng = random.Random(f"{seed}:{index}")
    kind = kind_of(seed, index)
    names = _families_for(kind)
    for _ in range(MAX_TRIES):
        family = rng.choice(names)
        shape = rng.choice(kind.shapes)
        two_nodes = rng.random() < TWO_NODES_P
        world = _world(rng, family, two_nodes)
        mesh = None
        if family == "mesh2d":
            mesh = rng.choice(((2, world // 2), (world // 2, 2)))
        fam = families.build(family, world, mesh, shape)
        plant = _plant(rng, fam, kind)
        if plant is None:
            continue
        culprits, mirror = _culprits(rng, fam, kind, plant, two_nodes)
        mode: Mode = "watch"
        if not two_nodes and kind.attachable and rng.random() < DIAGNOSE_P:
            mode = "diagnose"
        t = truth(fam, plant, kind, frozenset(culprits), frozenset(mirror))
        states = {rt.outcome.state for rt in t.roles()}
        if "unknown" in states or ("broken" in states and kind.name != "fsdp_eval"):
            continue  # a framework's backward met is predictable only where it is planted
        if not kind.healthy and "finished" in states:
            continue  # the fault does not show in this job
        if mode == "diagnose" and not kind.healthy and (
                states != {"hang"} or any(rt.outcome.partial for rt in t.roles())):
            # nothing stays stuck to attach to, or the stacks cannot tell who skipped
            mode = "watch"
        if mode == "diagnose" and kind.name in EXCLUSIVE and world < 3:
            mode = "watch"
        if mode == "diagnose" and kind.name == "wrong_group" and len(culprits) == 1:
            # the culprit and its partner wait at one line; only the group (a local the
            # tool does not keep, or the recorder) tells them apart
            mode = "watch"
        if mode == "diagnose" and kind.name != "recv_no_send" \
                and not all(stacks_single_out(rt) for rt in t.roles()):
            # a culprit stands where a rank that is not one stands (a mesh rank past its
            # tp all-reduce, at the line its dp peers are at): their stacks are the same,
            # and only the groups the recorder names tell them apart (a recv's peer is in
            # py-spy's locals: that one stacks do tell)
            mode = "watch"
        if kind.name == "busy" and mode == "diagnose":
            plant = Plant(plant.kind, plant.site, plant.step, plant.steps, plant.variant,
                          plant.module, 60.0)
        t = truth(fam, plant, kind, frozenset(culprits), frozenset(mirror), mode)
        stall, hang_after = _watch_options(rng, kind, plant)
        spec = JobSpec(seed, index, kind.name, family, world, mesh,
                       "two_nodes" if two_nodes else "torchrun", mode, plant, culprits,
                       mirror, stall, hang_after, shape, neighbour_of(seed, index),
                       mode == "watch" and stackless_of(seed, index))
        return spec, t
    raise RuntimeError(f"seed {seed} job {index}: no plant of {kind.name} found")


def _watch_options(rng: random.Random, kind: Kind, plant: Plant) -> tuple[float | None,
                                                                           float | None]:
    """--stall and --hang-after: a rank stuck outside every collective is uncertain until
    --hang-after (waited less than the default 300 s here); a healthy slow rank is slow for
    less than it."""
    stall = rng.choice((None, 3.0, 3.0, 5.0))
    if kind.name == "lock":
        return stall or 3.0, 15.0
    if kind.name == "sleep":
        return rng.choice((2.0, 3.0, 5.0)), plant.seconds + 30.0
    if kind.name == "busy":
        return rng.choice((2.0, 3.0, 5.0)), None
    return stall, None
