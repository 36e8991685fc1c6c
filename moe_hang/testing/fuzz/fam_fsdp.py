"""FSDP2 job shapes: ``fully_shard`` per block (``fsdp2``) and per expert of a mixture of
experts (``fsdp2_moe``). A forward all-gathers each unit's parameters as it is called; the
backward's re-gathers and reduce-scatters are one opaque stretch (their order is not
modelled)."""

from __future__ import annotations

from moe_hang.testing.fuzz.events import OPAQUE, Coll
from moe_hang.testing.fuzz.sites import TAIL, EventsFn, Family, Site, Unit, batch_site, coll

EXPERTS = 4
FSDP_IMPORTS = ("from torch.distributed.device_mesh import init_device_mesh",
                "from torch.distributed.fsdp import fully_shard")


def _fsdp_forward_events(modules: tuple[Unit, ...]) -> EventsFn:
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
    ), coll("world", OPAQUE, "fsdp_backward", "backward"), user=False, skip=None)


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
UNITS = (model.inp, *model.blocks, model.head)  # FSDP's units, in forward order
for module in UNITS:
    fully_shard(module, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)'''
    blocks = tuple(("block", "block", f"block{i}") for i in range(3))
    modules = (("inp", "inp", "inp"), *blocks, ("head", "head", "head"))

    def skipping(k: int) -> tuple[tuple[str, str, str], ...]:
        return tuple(m for m in modules if m[2] != f"block{k}")

    sites = (
        batch_site(),
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
                  "block is called", world, FSDP_IMPORTS, setup, sites, fsdp=True,
                  units=modules, eval_call="model(x_val)")


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
UNITS = (model.inp, model.router, *model.experts, model.head)  # FSDP's units, in forward order
for module in UNITS:
    fully_shard(module, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)'''
    experts = tuple(("expert", "expert", f"expert{e}") for e in range(EXPERTS))
    modules = (("inp", "inp", "inp"), ("router", "router", "router"), *experts,
               ("head", "head", "head"))

    def skipping(k: int) -> tuple[tuple[str, str, str], ...]:
        return tuple(m for m in modules if m[2] != f"expert{k}")

    sites = (
        batch_site(),
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
                  setup, sites, experts=True, fsdp=True, units=modules,
                  eval_call="model(x_val, torch.arange(8) % EXPERTS)")
