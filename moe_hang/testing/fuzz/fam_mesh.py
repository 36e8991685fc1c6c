"""Tensor- and pipeline-parallel job shapes: a DTensor row-sharded weight (``dtensor``), a
2-D device mesh with its tensor- and data-parallel subgroups (``mesh2d``), a send/recv
pipeline (``p2p``)."""

from __future__ import annotations

from moe_hang.testing.fuzz.events import P2P
from moe_hang.testing.fuzz.sites import LOG_SETUP, TAIL, Family, Site, batch_site, code, coll


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
        batch_site(),
        Site("gather", (
            "weight = proj.full_tensor() + 0  # corpus: gather",
        ), coll("world", "all_gather", "proj", "gather")),
        code("forward",
              "local = torch.nn.functional.mse_loss(head(x @ weight.T), y, reduction=\"sum\")"),
        Site("loss_reduce", (
            "partial = DTensor.from_local(local.detach().reshape(1), mesh, [Partial()])",
            "loss = partial.full_tensor() / (8 * WORLD)  # corpus: loss_reduce",
        ), coll("world", "all_reduce", "f32x1", "loss_reduce"), skip=None),
        code("backward",
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
        batch_site(),
        Site("tp_reduce", (
            "h = x @ w",
            "dist.all_reduce(h, group=tp)  # corpus: tp_reduce",
            "loss = h.square().mean()",
        ), coll("tp", "all_reduce", "f32x128", "tp_reduce"),
            alt=("broadcast", "dist.broadcast(h, group_src=0, group=tp)")),
        Site("dp_reduce", (
            "grad = torch.full((12,), loss.item())",
            "dist.all_reduce(grad, group={group})  # corpus: dp_reduce",
        ), coll("dp", "all_reduce", "f32x12", "dp_reduce"), group_var=True, swap_next=True,
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
        batch_site(),
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
