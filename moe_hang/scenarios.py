"""Which model each scenario builds on a rank, broken or fixed (torch; runs inside the workers).

ep-ragged     broken: NaiveDTensorDispatch            fixed: VarlenDispatch / a2a
ep-no-anchor  broken: VarlenDispatch(anchor=False)    fixed: VarlenDispatch / a2a
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_hang.config import ReproConfig
from moe_hang.ep import NaiveDTensorDispatch, VarlenDispatch
from moe_hang.moe import (
    GroupedExpertsLoRA,
    MoEConfig,
    MoELayer,
    MoEModel,
    layer_weights,
)


def moe_config(cfg: ReproConfig) -> MoEConfig:
    return MoEConfig(hidden=cfg.hidden, ffn=cfg.ffn, experts=cfg.experts, topk=cfg.topk,
                     lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, layers=cfg.layers,
                     seed=cfg.seed, dead_experts=tuple(cfg.dead_experts))


@dataclass
class EPModel:
    model: MoEModel
    first_expert: int
    num_local: int


def dispatch_name(cfg: ReproConfig) -> str:
    """The exchange a run uses: ``naive``, ``varlen``, ``varlen-no-anchor`` or ``a2a``."""
    if cfg.variant == "fixed":
        return cfg.fix
    return {"ep-ragged": "naive", "ep-no-anchor": "varlen-no-anchor"}.get(cfg.scenario, "naive")


def make_dispatch(name: str, mesh: Any) -> Any:
    group = mesh.get_group()
    if name == "naive":
        return NaiveDTensorDispatch(mesh)
    if name == "varlen":
        return VarlenDispatch(group)
    if name == "varlen-no-anchor":
        return VarlenDispatch(group, anchor=False)
    raise ValueError(f"no dispatch named {name!r}")


def build_ep_model(cfg: ReproConfig, mesh: Any, rank: int, device: torch.device) -> EPModel:
    """Experts sharded over the 1-D EP mesh: rank r owns experts [r*L, (r+1)*L)."""
    from torch.distributed.tensor import DTensor, Shard

    mcfg = moe_config(cfg)
    num_local = cfg.experts // cfg.nproc
    first = rank * num_local

    def shard(t: torch.Tensor, trainable: bool) -> nn.Parameter:
        # Every rank builds the full weights from the seed and keeps its slice: no scatter.
        dt = DTensor.from_local(t.to(device), mesh, [Shard(0)], run_check=False)
        return nn.Parameter(dt, requires_grad=trainable)

    dispatch = make_dispatch(dispatch_name(cfg), mesh)
    layers = []
    for i in range(cfg.layers):
        experts = GroupedExpertsLoRA(layer_weights(mcfg, i), first, num_local, mcfg.lora_scale,
                                     wrap=shard)
        layers.append(MoELayer(mcfg, i, experts, dispatch))
    model = MoEModel(layers).to(device)
    return EPModel(model, first, num_local)
