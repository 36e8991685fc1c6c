"""Which model each scenario builds on a rank, broken or fixed (torch; runs inside the workers).

============  ==================================  ========================================
scenario      broken                              fixes
============  ==================================  ========================================
ep-ragged     NaiveDTensorDispatch (pre-#3631)    varlen (VarlenDispatch), a2a
ep-no-anchor  VarlenDispatch(anchor=False)        varlen (with the anchor), a2a
fsdp-skip     FSDPExperts(call_all=False)         all-experts (FSDPExperts(call_all=True))
============  ==================================  ========================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moe_hang.config import RunConfig
from moe_hang.scenarios.a2a import AllToAllDispatch
from moe_hang.scenarios.ep import NaiveDTensorDispatch, VarlenDispatch
from moe_hang.scenarios.fsdp import FSDPExperts, shard_experts, uncovered_trainable
from moe_hang.scenarios.moe import (
    GroupedExpertsLoRA,
    MoELayer,
    MoEModel,
    layer_weights,
    local_dispatch,
)
from moe_hang.scenarios.registry import SCENARIOS


@dataclass
class Built:
    model: MoEModel
    uncovered: list[str] = field(default_factory=list)  # trainable params outside FSDP


def dispatch_name(cfg: RunConfig) -> str:
    """The exchange an EP run uses: naive, varlen, varlen-no-anchor or a2a (fsdp-skip builds
    no dispatch: see :func:`build`)."""
    if cfg.variant == "fixed":
        return cfg.fix
    return SCENARIOS[cfg.scenario].broken


def make_dispatch(name: str, mesh: Any, num_local: int) -> Any:
    group = mesh.get_group()
    if name == "naive":
        return NaiveDTensorDispatch(mesh)
    if name == "varlen":
        return VarlenDispatch(group)
    if name == "varlen-no-anchor":
        return VarlenDispatch(group, anchor=False)
    if name == "a2a":
        return AllToAllDispatch(group, num_local)
    raise ValueError(f"no dispatch named {name!r}")


def build_ep_model(cfg: RunConfig, mesh: Any, rank: int, device: torch.device) -> Built:
    """Experts sharded over the 1-D EP mesh: rank r owns experts [r*L, (r+1)*L)."""
    from torch.distributed.tensor import DTensor, Shard

    mcfg = cfg.model
    num_local = mcfg.experts // cfg.nproc
    first = rank * num_local

    def shard(t: torch.Tensor, trainable: bool) -> nn.Parameter:
        # Every rank builds the full weights from the seed and keeps its slice: no scatter.
        dt = DTensor.from_local(t.to(device), mesh, [Shard(0)], run_check=False)
        return nn.Parameter(dt, requires_grad=trainable)

    dispatch = make_dispatch(dispatch_name(cfg), mesh, num_local)
    layers = []
    for i in range(mcfg.layers):
        experts = GroupedExpertsLoRA(layer_weights(mcfg, i), first, num_local, mcfg.lora_scale,
                                     wrap=shard)
        layers.append(MoELayer(mcfg, i, experts, dispatch))
    model = MoEModel(layers).to(device)
    return Built(model)


def build_fsdp_model(cfg: RunConfig, mesh: Any, device: torch.device,
                     before_unshard: Callable[[int, int], Callable[..., None]] | None = None,
                     ) -> Built:
    """Every expert a ``fully_shard`` unit over all ranks; tokens stay on their rank."""
    mcfg = cfg.model
    call_all = cfg.variant == "fixed"
    layers = []
    for i in range(mcfg.layers):
        experts = FSDPExperts(layer_weights(mcfg, i), mcfg.experts, mcfg.lora_scale, call_all,
                              with_lora=not cfg.lora_outside_fsdp)
        layers.append(MoELayer(mcfg, i, experts, local_dispatch))
    model = MoEModel(layers).to(device)
    shard_experts(layers, mesh, cfg.lora_outside_fsdp, lambda li: layer_weights(mcfg, li),
                  before_unshard)
    return Built(model, uncovered_trainable(model))


def build(cfg: RunConfig, mesh: Any, rank: int, device: torch.device,
          before_unshard: Callable[[int, int], Callable[..., None]] | None = None) -> Built:
    if cfg.scenario == "fsdp-skip":
        return build_fsdp_model(cfg, mesh, device, before_unshard)
    return build_ep_model(cfg, mesh, rank, device)
