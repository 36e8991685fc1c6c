"""The built-in model as the single-process reference that ``verify --fixed`` compares with,
in the form ``moe_hang.check(reference=...)`` takes a user's: verify runs the same reference
runner (:mod:`moe_hang.usercheck.reference`) with ``reference`` and ``batch`` below, on the
ranks' ``result.pt`` in the same layout. The run's config is read from ``MOE_HANG_RUN_CONFIG``
(the run directory's ``config.json``; repro sets it).

``reference()`` builds the scenario's model with every expert local and no process group
(the grouped experts of the EP scenarios; fsdp-skip's one module per expert, unsharded, so
that its parameters carry the ranks' names), under a wrapper whose output carries this rank's
share of the global loss, and the workers' optimizer. ``batch(rank, step)`` is rank's slice
of the global batch. The ranks' gradients sum to the global one (``--reduce sum``): EP sums
through its exchange; fsdp-skip's ranks scale their share by the world size before FSDP's
average.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_hang.config import RunConfig
from moe_hang.scenarios.fsdp import FSDPExperts
from moe_hang.scenarios.moe import (
    MoELayer,
    MoEModel,
    build_reference_model,
    global_batch,
    layer_weights,
    local_dispatch,
    local_loss,
)
from moe_hang.scenarios.registry import ENV_RUN_CONFIG


@functools.cache
def _config() -> RunConfig:
    return RunConfig.from_dict(json.loads(Path(os.environ[ENV_RUN_CONFIG]).read_text()))


@dataclass
class Output:
    """What the reference runner judges a step by: ``.logits`` and ``.loss``."""

    logits: torch.Tensor
    loss: torch.Tensor


class WithLoss(nn.Module):
    """The model under ``module.`` (a wrapper's prefix, dropped from parameter names)."""

    def __init__(self, module: MoEModel, total_tokens: int):
        super().__init__()
        self.module, self.total_tokens = module, total_tokens

    def forward(self, x_TD: torch.Tensor) -> Output:
        out_TD = self.module(x_TD)
        return Output(out_TD, local_loss(out_TD, self.total_tokens))


def reference_model(cfg: RunConfig) -> MoEModel:
    """Every expert local: grouped for the EP scenarios, one module each for fsdp-skip."""
    mcfg = cfg.model
    if cfg.scenario != "fsdp-skip":
        return build_reference_model(mcfg)
    return MoEModel([MoELayer(mcfg, i, FSDPExperts(layer_weights(mcfg, i), mcfg.experts,
                                                   mcfg.lora_scale, call_all=True),
                              local_dispatch)
                     for i in range(mcfg.layers)])


def reference() -> tuple[nn.Module, Any]:
    cfg = _config()
    model = WithLoss(reference_model(cfg), cfg.total_tokens)
    lora = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.SGD(lora, lr=cfg.lr, foreach=False)


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the global batch of step ``step`` (the workers count from 1)."""
    cfg = _config()
    offset = cfg.offsets()[rank]
    return global_batch(cfg.model, cfg.total_tokens, step + 1)[offset:offset + cfg.tokens[rank]]
