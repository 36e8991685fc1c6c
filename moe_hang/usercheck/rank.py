"""One rank of ``moe_hang.check``: the user's ``build`` and ``batch`` (imported by name), a few
training steps, nothing else — run under ``torchrun`` by :func:`moe_hang.usercheck.api.check`,
so that moe-hang check's plans reach its routers as they reach any job's.

``build()`` returns the model (sharded as the user shards it: it runs inside the rank, after
the process group exists, with ``torch.manual_seed(0)`` just before), or ``(model,
optimizer)``; ``batch(rank, step)`` returns the input: a tensor, a tuple of positional
arguments or a dict of keyword arguments. The loss is the model output's ``.loss`` when it
has one, else the mean of its first floating tensor.

With ``--save`` (a reference to compare with was given) the rank keeps, every step, its
output, its loss and the whole gradient of every parameter its optimizer steps (a sharded
DTensor gradient gathered: every rank gathers the same ones in the same order), and writes
them to its ``result.pt`` when the last step is done (usercheck/reference.py compares them).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SEED = 0  # torch.manual_seed before build() here and before reference() in the reference
LR = 1e-3  # the default optimizer's (SGD) when build() returns no optimizer
# wrappers whose prefix is not the model's: FSDP1, torch.compile, DDP, activation checkpointing
_WRAPPERS = ("_fsdp_wrapped_module.", "_orig_mod.", "module.", "_checkpoint_wrapped_module.")


def load(ref: str) -> Callable[..., Any]:
    mod, _, name = ref.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def model_and_optimizer(made: Any) -> tuple[Any, Any]:
    """``build()``'s model and optimizer: its own, or SGD over what requires a gradient."""
    import torch

    model, opt = made if isinstance(made, tuple) else (made, None)
    if opt is None:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    return model, opt


def forward(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def output(out: Any) -> Any:
    """The tensor a step is judged by: ``.logits``, the output itself or its first floating
    tensor."""
    import torch

    logits = getattr(out, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(out, (tuple, list)):
        return next(t for t in out if torch.is_tensor(t) and t.is_floating_point())
    return out


def loss_of(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    return loss if loss is not None else output(out).float().mean()


def clean_name(name: str) -> str:
    """A parameter's name as the unwrapped model spells it (a reference has no wrappers)."""
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    return name


def dtypes(model: Any, out: Any) -> list[str]:
    """The floating dtypes the model computes in: its parameters' and its output's."""
    found = {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
    return sorted(found | {str(output(out).dtype)})


def stepped_grads(model: Any, opt: Any) -> dict[str, Any]:
    """The whole gradient of every parameter ``opt`` steps, by name (None: no gradient). A
    DTensor's is gathered: a collective, posted by every rank in the same order."""
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    grads: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if id(p) not in stepped:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        grads[clean_name(name)] = None if g is None else g.detach().float().cpu().clone()
    return grads


def main(argv: list[str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(prog="moe_hang.usercheck.rank")
    ap.add_argument("--build", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args(argv)
    build, batch = load(args.build), load(args.batch)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model, opt = model_and_optimizer(build())
    kept: list[dict[str, Any]] = []
    seen: set[str] = set()
    for step in range(args.steps):
        out = forward(model, batch(rank, step))
        loss = loss_of(out)
        loss.backward()
        if args.save:
            seen.update(dtypes(model, out))
            kept.append({"out": output(out).detach().float().cpu().clone(),
                         "loss": float(loss.item()), "grads": stepped_grads(model, opt)})
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} done", flush=True)
    if args.save:
        from moe_hang.probe.env import ENV_DIR
        from moe_hang.probe.layout import RankFiles

        ranks_dir = os.environ.get(ENV_DIR)
        if ranks_dir:  # under moe-hang's watch (always, from moe_hang.check)
            torch.save({"rank": rank, "steps": kept, "dtypes": sorted(seen)},
                       RankFiles(Path(ranks_dir), rank).result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
