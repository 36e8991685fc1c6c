"""The job shapes a fault is planted in: how the model and its process groups are set up, and
the statements of one training step, each a :class:`Site` with the collectives it posts.

A site's source uses placeholders that :mod:`.render` fills in: ``{n}`` (its number of
elements), ``{dt}`` (its dtype), ``{group}`` (the group it is posted on), ``{skip}`` (the
module a forward skips); the line that posts the collective ends in ``# corpus: <name>``.
What a site posts is given per rank (``events``), so the simulator and the ground truth
follow the same code the job runs. Shapes are chosen so that no two different collectives a
rank may meet have the same bytes (gloo would pair them silently)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from moe_hang.testing.fuzz.events import OPAQUE, P2P, Coll, Event, GroupKey

EventsFn = Callable[[int, int], tuple[Event, ...]]  # (rank, world) -> what it posts
SkipStyle = Literal["wrap", "continue", "module"]

FAMILIES = ("plain", "ddp", "fsdp2", "fsdp2_moe", "dtensor", "mesh2d", "p2p")
EXPERTS = 4


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

    def members(self, group: GroupKey, rank: int) -> tuple[int, ...]:
        if group in ("world", "log"):
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


def worlds(name: str) -> tuple[int, ...]:
    """World sizes a family is generated with (a 2-D mesh needs an even world of 4 or more)."""
    return (4, 6, 8) if name == "mesh2d" else (2, 3, 4, 6, 8)


def _one(ev: Event) -> EventsFn:
    return lambda rank, world: (ev,)


def _coll(group: GroupKey, op: str, tag: str, marker: str) -> EventsFn:
    return _one(Coll(group, op, tag, marker))


def _none(rank: int, world: int) -> tuple[Event, ...]:
    return ()


# --- what every family ends its step with: the user's own logging -----------------------

TAIL: tuple[Site, ...] = (
    Site("stats", (
        "stats = torch.zeros({n}, dtype={dt})",
        "stats[0], stats[1] = loss.item(), float(step)",
        "dist.all_reduce(stats)  # corpus: stats",
    ), _coll("world", "all_reduce", "f32x4", "stats"), size=(4, 6), dtype=True,
        alt=("broadcast", "dist.broadcast(stats, 0)"), swap_next=True),
    Site("metrics", (
        "mine = torch.full(({n},), float(RANK), dtype={dt})",
        "seen = torch.empty({n} * WORLD, dtype={dt})",
        "dist.all_gather_into_tensor(seen, mine, group=LOG)  # corpus: metrics",
    ), _coll("log", "all_gather", "f32x3", "metrics"), size=(3, 5), dtype=True,
        alt=("barrier", "dist.barrier(group=LOG)")),
    Site("stop", (
        "stop = torch.tensor([float(step == STEPS - 1)])",
        "dist.broadcast(stop, 0)  # corpus: stop",
    ), _coll("world", "broadcast", "f32x1", "stop"),
        alt=("all_reduce", "dist.all_reduce(stop)")),
)

LOG_SETUP = "LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger"


def _code(name: str, *lines: str, skip: SkipStyle | None = None) -> Site:
    """Statements that post nothing (``skip='continue'``: a step may be skipped here)."""
    return Site(name, lines, _none, user=False, skip=skip)


def _batch_site() -> Site:
    return _code("batch", "x, y = batch(step)", skip="continue")


# --- the families ------------------------------------------------------------------------------

def plain(world: int) -> Family:
    setup = "\n".join((
        LOG_SETUP,
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), "
        "torch.nn.Linear(16, 1))",
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
        "params = list(model.parameters())",
    ))
    sites = (
        _batch_site(),
        _code("forward",
              "loss = torch.nn.functional.mse_loss(model(x), y)",
              "opt.zero_grad()",
              "loss.backward()"),
        Site("grads", (
            "flat = torch.cat([p.grad.flatten() for p in params])",
            "dist.all_reduce(flat)  # corpus: grads",
            "offset = 0",
            "for p in params:",
            "    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / WORLD)",
            "    offset += p.numel()",
            "opt.step()",
        ), _coll("world", "all_reduce", "f32x161", "grads"),
            alt=("broadcast", "dist.broadcast(flat, 0)")),
        *TAIL,
    )
    return Family("plain", "data parallel by hand: gradients flattened and all-reduced",
                  world, (), setup, sites)


def ddp(world: int) -> Family:
    setup = "\n".join((
        LOG_SETUP,
        "model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), "
        "torch.nn.Linear(16, 1)))",
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
    ))
    sites = (
        _batch_site(),
        _code("forward",
              "loss = torch.nn.functional.mse_loss(model(x), y)",
              "opt.zero_grad()"),
        Site("backward", (
            "loss.backward()  # corpus: backward",
            "opt.step()",
        ), _coll("world", "all_reduce", "f32x161", "backward"), user=False, skip=None),
        *TAIL,
    )
    return Family("ddp", "DistributedDataParallel: the gradient bucket all-reduced in "
                  "backward", world,
                  ("from torch.nn.parallel import DistributedDataParallel as DDP",),
                  setup, sites)


FSDP_IMPORTS = ("from torch.distributed.device_mesh import init_device_mesh",
                "from torch.distributed.fsdp import fully_shard")


def _fsdp_forward_events(modules: tuple[tuple[str, str, str], ...]) -> EventsFn:
    """FSDP2's pre-forward all-gathers: one per module, in call order (tag, marker, ident)."""
    return lambda rank, world: tuple(Coll("world", "all_gather", tag, marker, ident)
                                     for tag, marker, ident in modules)


def _fsdp_backward() -> Site:
    # FSDP2's backward (re-gathers and reduce-scatters, with implicit prefetch): the same on
    # every rank; its order is not modelled, only that every rank is in it
    return Site("backward", (
        "loss.backward()  # corpus: backward",
        "opt.step()",
        "opt.zero_grad()",
    ), _coll("world", OPAQUE, "fsdp_backward", "backward"), user=False, skip=None)


def fsdp2(world: int) -> Family:
    setup = '''LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger
mesh = init_device_mesh("cpu", (WORLD,))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 24)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))
        self.head = torch.nn.Linear(24, 1)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        h = torch.relu(self.inp(x))  # corpus: inp
        for i, block in enumerate(self.blocks):
            if i == skip:
                continue  # the fast path: this block is skipped for short batches
            h = h + torch.relu(block(h))  # corpus: block
        return self.head(h)  # corpus: head


model = Net()
for module in (model.inp, *model.blocks, model.head):
    fully_shard(module, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)'''
    blocks = tuple(("block", "block", f"block{i}") for i in range(3))
    modules = (("inp", "inp", "inp"), *blocks, ("head", "head", "head"))

    def skipping(k: int) -> tuple[tuple[str, str, str], ...]:
        return tuple(m for m in modules if m[2] != f"block{k}")

    sites = (
        _batch_site(),
        Site("forward", (
            "loss = torch.nn.functional.mse_loss(model(x, skip={skip}), y)  # corpus: forward",
        ), _fsdp_forward_events(modules), user=False, skip="module",
            module_skip=lambda k: (f"skip = {k} if FAULTY and step == FAULT_STEP else None"
                                   "  # corpus: planted",),
            modules=3,
            skip_events=lambda rank, world, k: _fsdp_forward_events(skipping(k))(rank, world)),
        _fsdp_backward(),
        *TAIL,
    )
    return Family("fsdp2", "FSDP2 (fully_shard per block): parameters all-gathered as each "
                  "block is called", world, FSDP_IMPORTS, setup, sites, fsdp=True)


def fsdp2_moe(world: int) -> Family:
    setup = f'''LOG = dist.new_group(list(range(WORLD)))  # a second group, for the logger
mesh = init_device_mesh("cpu", (WORLD,))
EXPERTS = {EXPERTS}


class MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 24)
        self.router = torch.nn.Linear(8, EXPERTS)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(EXPERTS))
        self.head = torch.nn.Linear(24, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))  # corpus: inp
        gate = torch.softmax(self.router(x), dim=-1)  # corpus: router
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if idx.numel() == 0:
                continue  # no token for this expert on this rank
            out = out.index_add(0, idx, expert(h[idx]) * gate[idx, e:e + 1])  # corpus: expert
        return self.head(h + out)  # corpus: head


model = MoE()
for module in (model.inp, model.router, *model.experts, model.head):
    fully_shard(module, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)'''
    experts = tuple(("expert", "expert", f"expert{e}") for e in range(EXPERTS))
    modules = (("inp", "inp", "inp"), ("router", "router", "router"), *experts,
               ("head", "head", "head"))

    def skipping(k: int) -> tuple[tuple[str, str, str], ...]:
        return tuple(m for m in modules if m[2] != f"expert{k}")

    sites = (
        _batch_site(),
        Site("forward", (
            "route = (torch.arange(8) + RANK + step) % EXPERTS  # the router's choice per token",
            "loss = torch.nn.functional.mse_loss(model(x, route), y)  # corpus: forward",
        ), _fsdp_forward_events(modules), user=False, skip="module",
            module_skip=lambda k: (
                "if FAULTY and step == FAULT_STEP:  # corpus: planted",
                f"    route[route == {k}] = {(k + 1) % EXPERTS}  # no token for expert {k} "
                "on this rank"),
            modules=EXPERTS,
            skip_events=lambda rank, world, k: _fsdp_forward_events(skipping(k))(rank, world)),
        _fsdp_backward(),
        *TAIL,
    )
    return Family("fsdp2_moe", f"FSDP2 mixture of {EXPERTS} experts (fully_shard per expert), "
                  "a loop that calls only the experts that got tokens", world, FSDP_IMPORTS,
                  setup, sites, experts=True, fsdp=True)


def dtensor(world: int) -> Family:
    setup = "\n".join((
        LOG_SETUP,
        'mesh = init_device_mesh("cpu", (WORLD,))',
        "# a column-parallel projection: its rows are sharded over the mesh",
        "proj = distribute_tensor(torch.randn(4 * WORLD, 8), mesh, [Shard(0)])",
        "head = torch.nn.Linear(4 * WORLD, 1)",
        "opt = torch.optim.SGD(head.parameters(), lr=0.01)",
        "weight = torch.zeros(4 * WORLD, 8)",
    ))
    sites = (
        _batch_site(),
        Site("gather", (
            "weight = proj.full_tensor() + 0  # corpus: gather",
        ), _coll("world", "all_gather", "proj", "gather")),
        _code("forward",
              "local = torch.nn.functional.mse_loss(head(x @ weight.T), y, reduction=\"sum\")"),
        Site("loss_reduce", (
            "partial = DTensor.from_local(local.detach().reshape(1), mesh, [Partial()])",
            "loss = partial.full_tensor() / (8 * WORLD)  # corpus: loss_reduce",
        ), _coll("world", "all_reduce", "f32x1", "loss_reduce"), skip=None),
        _code("backward",
              "opt.zero_grad()",
              "local.backward()",
              "opt.step()"),
        *TAIL,
    )
    return Family("dtensor", "DTensor: a row-sharded weight gathered with full_tensor(), the "
                  "loss reduced from a Partial", world,
                  ("from torch.distributed.device_mesh import init_device_mesh",
                   "from torch.distributed.tensor import DTensor, Partial, Shard, "
                   "distribute_tensor"),
                  setup, sites)


def mesh2d(world: int, mesh: tuple[int, int]) -> Family:
    dp, tp = mesh
    setup = "\n".join((
        f'mesh = init_device_mesh("cpu", ({dp}, {tp}), mesh_dim_names=("dp", "tp"))',
        'dp, tp = mesh.get_group("dp"), mesh.get_group("tp")',
        LOG_SETUP,
        "w = torch.randn(8, 16)  # this rank's tensor-parallel slice",
    ))
    sites = (
        _batch_site(),
        Site("tp_reduce", (
            "h = x @ w",
            "dist.all_reduce(h, group=tp)  # corpus: tp_reduce",
            "loss = h.square().mean()",
        ), _coll("tp", "all_reduce", "f32x128", "tp_reduce"),
            alt=("broadcast", "dist.broadcast(h, group_src=0, group=tp)")),
        Site("dp_reduce", (
            "grad = torch.full((12,), loss.item())",
            "dist.all_reduce(grad, group={group})  # corpus: dp_reduce",
        ), _coll("dp", "all_reduce", "f32x12", "dp_reduce"), group_var=True, swap_next=True,
            alt=("broadcast", "dist.broadcast(grad, group_src=0, group=dp)")),
        *TAIL,
    )
    return Family("mesh2d", f"a {dp}x{tp} device mesh (dp, tp): tensor-parallel and "
                  "data-parallel subgroups", world,
                  ("from torch.distributed.device_mesh import init_device_mesh",), setup,
                  sites, mesh=mesh)


def p2p(world: int) -> Family:
    setup = "\n".join((
        LOG_SETUP,
        "stage = torch.nn.Linear(8, 8)  # this rank's pipeline stage",
    ))
    sites = (
        _batch_site(),
        Site("recv", (
            "if RANK > 0:",
            "    x = torch.empty(8, 8)",
            "    dist.recv(x, RANK - 1)  # corpus: recv",
        ), lambda rank, world: (P2P("recv", rank - 1, "act", "recv"),) if rank > 0 else (),
            user=False, skip=None),
        Site("send", (
            "h = torch.relu(stage(x))",
            "if RANK < WORLD - 1:",
            "    dist.send(h.detach(), RANK + 1)  # corpus: send",
            "loss = h.square().mean()",
        ), lambda rank, world: ((P2P("send", rank + 1, "act", "send"),)
                                if rank < world - 1 else ()),
            user=False, skip=None, send=True,
            runs_on=lambda rank, world: rank < world - 1),
        *TAIL,
    )
    return Family("p2p", "a pipeline: each stage receives from the previous rank and sends "
                  "to the next", world, (), setup, sites)


def build(name: str, world: int, mesh: tuple[int, int] | None = None) -> Family:
    if name == "mesh2d":
        if mesh is None or mesh[0] * mesh[1] != world:
            raise ValueError(f"mesh2d on {world} ranks needs a mesh of {world}")
        return mesh2d(world, mesh)
    makers: dict[str, Callable[[int], Family]] = {
        "plain": plain, "ddp": ddp, "fsdp2": fsdp2, "fsdp2_moe": fsdp2_moe,
        "dtensor": dtensor, "p2p": p2p}
    if name not in makers:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return makers[name](world)
