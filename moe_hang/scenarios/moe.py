"""A minimal 2-layer mixture-of-experts model with LoRA on its experts.

Small enough to hold in your head, shaped like the real thing: a softmax top-k router, grouped
SwiGLU experts (``gate_up [E, D, 2F]``, ``down [E, F, D]``) and LoRA adapters on both expert
projections. The expert-parallel exchange lives in :mod:`moe_hang.scenarios.ep`; this file
never talks to other ranks itself.

Shape legend (suffixes on tensor names, as in torchtitan):
  T  tokens on this rank               G  tokens gathered from every EP rank
  N  rows routed to one expert         D  hidden size
  F  expert FFN size                   E  experts in a layer (global)
  L  experts local to this rank        K  experts per token (top-k)
  R  LoRA rank
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_hang.config import ModelConfig

LORA_NAMES = ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B")


def layer_weights(cfg: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    """All weights of one layer, for all E experts, from the seed (identical on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + layer)
    D, F_, E, R = cfg.hidden, cfg.ffn, cfg.experts, cfg.lora_rank

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    return {
        "router_DE": randn(D, E, std=1.0 / math.sqrt(D)),
        "gate_up_ED2F": randn(E, D, 2 * F_, std=1.0 / math.sqrt(D)),
        "down_EFD": randn(E, F_, D, std=1.0 / math.sqrt(F_)),
        "lora_gate_up_A": randn(E, D, R, std=1.0 / math.sqrt(D)),
        # B is small but non-zero so LoRA changes the output and every adapter gets a gradient.
        "lora_gate_up_B": randn(E, R, 2 * F_, std=0.02),
        "lora_down_A": randn(E, F_, R, std=1.0 / math.sqrt(F_)),
        "lora_down_B": randn(E, R, D, std=0.02),
    }


def global_batch(cfg: ModelConfig, total_tokens: int, step: int) -> torch.Tensor:
    """The synthetic hidden states of one step for the whole global batch: ``x_TD`` of all ranks."""
    g = torch.Generator().manual_seed(cfg.seed * 7919 + 100_003 * step + 1)
    return torch.randn(total_tokens, cfg.hidden, generator=g, dtype=torch.float32)


class Router(nn.Module):
    """Softmax top-k router (frozen). Dead experts are masked out so no token reaches them."""

    def __init__(self, router_DE: torch.Tensor, topk: int, dead_experts: tuple[int, ...] = ()):
        super().__init__()
        self.router_DE = nn.Parameter(router_DE.clone(), requires_grad=False)
        self.topk = topk
        dead_E = torch.zeros(router_DE.shape[1], dtype=torch.bool)
        dead_E[list(dead_experts)] = True
        self.register_buffer("dead_E", dead_E, persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dead_E = self.get_buffer("dead_E")
        logits_TE = (x_TD @ self.router_DE).masked_fill(dead_E, float("-inf"))
        probs_TE = torch.softmax(logits_TE, dim=-1)
        weights_TK, experts_TK = torch.topk(probs_TE, self.topk, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, experts_TK


def expert_ffn(
    x_ND: torch.Tensor,
    gate_up_D2F: torch.Tensor,
    down_FD: torch.Tensor,
    lora: dict[str, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """One SwiGLU expert with LoRA on both projections: ``W x + scale * B(A x)``."""
    h_N2F = x_ND @ gate_up_D2F + scale * ((x_ND @ lora["lora_gate_up_A"]) @ lora["lora_gate_up_B"])
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    a_NF = F.silu(gate_NF) * up_NF
    return a_NF @ down_FD + scale * ((a_NF @ lora["lora_down_A"]) @ lora["lora_down_B"])


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor behind a parameter (DTensor shards give their local piece)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GroupedExpertsLoRA(nn.Module):
    """Experts ``[first, first + L)`` of a layer, base weights frozen, LoRA trainable.

    ``forward`` computes only this rank's share: for every row routed to a local expert it adds
    ``weight * expert(x)``; rows routed elsewhere stay zero. It has no collectives, so skipping an
    expert that got no rows is safe *here* (contrast :mod:`moe_hang.scenarios.fsdp`, where it is
    not).
    Parameters may be DTensors sharded on the expert dimension; compute uses their local shard.
    """

    def __init__(self, weights: dict[str, torch.Tensor], first: int, num_local: int,
                 scale: float, wrap: Callable[[torch.Tensor, bool], nn.Parameter] | None = None):
        super().__init__()
        self.first, self.num_local, self.scale = first, num_local, scale
        sl = slice(first, first + num_local)

        def make(t: torch.Tensor, trainable: bool) -> nn.Parameter:
            if wrap is not None:
                return wrap(t[sl].contiguous(), trainable)
            return nn.Parameter(t[sl].clone(), requires_grad=trainable)

        self.gate_up_LD2F = make(weights["gate_up_ED2F"], False)
        self.down_LFD = make(weights["down_EFD"], False)
        self.lora_gate_up_A = make(weights["lora_gate_up_A"], True)
        self.lora_gate_up_B = make(weights["lora_gate_up_B"], True)
        self.lora_down_A = make(weights["lora_down_A"], True)
        self.lora_down_B = make(weights["lora_down_B"], True)

    def lora_params(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in LORA_NAMES}

    def forward(self, x_GD: torch.Tensor, weights_GK: torch.Tensor,
                experts_GK: torch.Tensor) -> torch.Tensor:
        gate_up, down = local_tensor(self.gate_up_LD2F), local_tensor(self.down_LFD)
        lora = {n: local_tensor(p) for n, p in self.lora_params().items()}
        y_GD = torch.zeros_like(x_GD)
        for j in range(self.num_local):
            rows_N, slot_N = (experts_GK == self.first + j).nonzero(as_tuple=True)
            if rows_N.numel() == 0:
                continue  # no collective inside, so a rank may skip freely
            out_ND = expert_ffn(x_GD[rows_N], gate_up[j], down[j],
                                {n: t[j] for n, t in lora.items()}, self.scale)
            y_GD = y_GD.index_add(0, rows_N, out_ND * weights_GK[rows_N, slot_N].unsqueeze(-1))
        return y_GD


# A dispatcher moves tokens to the experts that own them and brings the results back:
# (x_TD, weights_TK, experts_TK, experts) -> y_TD. See moe_hang.scenarios.ep for the EP ones.
Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]


def local_dispatch(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                   experts: nn.Module) -> torch.Tensor:
    """No exchange: all experts are local (the single-process reference)."""
    return experts(x_TD, weights_TK, experts_TK)


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, experts: nn.Module, dispatch: Dispatch):
        super().__init__()
        w = layer_weights(cfg, layer)
        self.layer = layer
        self.router = Router(w["router_DE"], cfg.topk, cfg.dead_in(layer))
        self.experts = experts
        self.dispatch = dispatch

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        weights_TK, experts_TK = self.router(x_TD)
        return x_TD + self.dispatch(x_TD, weights_TK, experts_TK, self.experts)


class MoEModel(nn.Module):
    """``cfg.layers`` MoE layers with residual connections over synthetic hidden states."""

    def __init__(self, layers: list[MoELayer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_TD = layer(x_TD)
        return x_TD


def local_loss(out_TD: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """This rank's share of the global loss; the shares sum to the single-process loss."""
    return (out_TD * out_TD).mean(dim=-1).sum() / total_tokens


def build_reference_model(cfg: ModelConfig) -> MoEModel:
    """All experts local, no process group: the model the EP runs must match."""
    layers = []
    for i in range(cfg.layers):
        experts = GroupedExpertsLoRA(layer_weights(cfg, i), 0, cfg.experts, cfg.lora_scale)
        layers.append(MoELayer(cfg, i, experts, local_dispatch))
    return MoEModel(layers)


def tokens_per_expert(experts_TK: torch.Tensor, num_experts: int) -> list[int]:
    return torch.bincount(experts_TK.flatten(), minlength=num_experts).tolist()
