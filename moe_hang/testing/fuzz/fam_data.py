"""Data-parallel job shapes: gradients all-reduced by hand (``plain``) and by
DistributedDataParallel in backward (``ddp``)."""

from __future__ import annotations

from moe_hang.testing.fuzz.sites import LOG_SETUP, TAIL, Family, Site, batch_site, code, coll


def plain(world: int) -> Family:
    setup = "\n".join((
        LOG_SETUP,
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), "
        "torch.nn.Linear(16, 1))",
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
        "params = list(model.parameters())",
    ))
    sites = (
        batch_site(),
        code("forward",
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
        ), coll("world", "all_reduce", "f32x161", "grads"),
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
        batch_site(),
        code("forward",
              "loss = torch.nn.functional.mse_loss(model(x), y)",
              "opt.zero_grad()"),
        Site("backward", (
            "loss.backward()  # corpus: backward",
            "opt.step()",
        ), coll("world", "all_reduce", "f32x161", "backward"), user=False, skip=None),
        *TAIL,
    )
    return Family("ddp", "DistributedDataParallel: the gradient bucket all-reduced in "
                  "backward", world,
                  ("from torch.nn.parallel import DistributedDataParallel as DDP",),
                  setup, sites)
