"""One rank of ``moe_hang.check``: the user's ``build`` and ``batch`` (imported by name), a few
training steps, nothing else — run under ``torchrun`` by :func:`moe_hang.usercheck.api.check`,
so that moe-hang check's plans reach its routers as they reach any job's.

``build()`` returns the model (sharded as the user shards it: it runs inside the rank, after
the process group exists), or ``(model, optimizer)``; ``batch(rank, step)`` returns the input:
a tensor, a tuple of positional arguments or a dict of keyword arguments. The loss is the
model output's ``.loss`` when it has one, else the mean of its first tensor.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
from collections.abc import Callable
from typing import Any


def load(ref: str) -> Callable[..., Any]:
    mod, _, name = ref.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _loss(out: Any) -> Any:
    import torch

    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    if isinstance(out, (tuple, list)):
        out = next(t for t in out if torch.is_tensor(t) and t.is_floating_point())
    return out.float().mean()


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(prog="moe_hang.usercheck.rank")
    ap.add_argument("--build", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    build, batch = load(args.build), load(args.batch)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    made = build()
    model, opt = made if isinstance(made, tuple) else (made, None)
    if opt is None:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(args.steps):
        inputs = batch(rank, step)
        if isinstance(inputs, dict):
            out = model(**inputs)
        elif isinstance(inputs, tuple):
            out = model(*inputs)
        else:
            out = model(inputs)
        _loss(out).backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
