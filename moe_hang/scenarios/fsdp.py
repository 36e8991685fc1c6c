"""FSDP2 + MoE + LoRA: the zero-token skip (seed write-up "FSDP MoE PEFT hangs during forward").

Every expert (its frozen base weights *and* its LoRA adapters) is one ``fully_shard`` unit over
all ranks; tokens stay on their rank. FSDP's pre-forward hook all-gathers an expert's
parameters when the expert is *called*, so::

    for e, expert in enumerate(experts):
        if mask.any():            # broken: on a rank that routed no token to e, the all-gather
            out += expert(x[mask])  # of e is skipped there only, and every later collective
                                    # pairs with the wrong partner

The fix calls every expert every step, with an empty input where it has no token, which
changes nothing in the result. LoRA parameters added *after* ``fully_shard`` (PEFT applied
after wrapping) are plain replicated tensors outside FSDP: they get no gradient reduction.
:func:`uncovered_trainable` names them; ``verify`` refuses to pass with any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moe_hang.scenarios.moe import LORA_NAMES, expert_ffn


class ExpertLoRA(nn.Module):
    """One SwiGLU expert with LoRA, cut out of the grouped weights of its layer."""

    def __init__(self, weights: dict[str, torch.Tensor], e: int, scale: float,
                 with_lora: bool = True):
        super().__init__()
        self.scale = scale
        self.gate_up_D2F = nn.Parameter(weights["gate_up_ED2F"][e].clone(), requires_grad=False)
        self.down_FD = nn.Parameter(weights["down_EFD"][e].clone(), requires_grad=False)
        if with_lora:
            self.add_lora(weights, e)

    def add_lora(self, weights: dict[str, torch.Tensor], e: int) -> None:
        for name in LORA_NAMES:
            setattr(self, name, nn.Parameter(weights[name][e].clone().to(self.down_FD.device)))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        lora = {n: getattr(self, n) for n in LORA_NAMES}
        return expert_ffn(x_ND, self.gate_up_D2F, self.down_FD, lora, self.scale)


class FSDPExperts(nn.Module):
    """All E experts, each a ``fully_shard`` unit, run on this rank's own tokens."""

    def __init__(self, weights: dict[str, torch.Tensor], num_experts: int, scale: float,
                 call_all: bool, with_lora: bool = True):
        super().__init__()
        self.call_all = call_all
        self.experts = nn.ModuleList(ExpertLoRA(weights, e, scale, with_lora)
                                     for e in range(num_experts))

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                experts_TK: torch.Tensor) -> torch.Tensor:
        y_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            rows_N, slot_N = (experts_TK == e).nonzero(as_tuple=True)
            if not self.call_all and rows_N.numel() == 0:
                continue  # BROKEN: skips this expert's FSDP all-gather on this rank only
            # Calling the expert (even on zero rows) runs FSDP's pre-forward all-gather of its
            # parameters on every rank, and puts it in the graph so its backward
            # reduce-scatter runs on every rank too.
            out_ND = expert(x_TD[rows_N])
            y_TD = y_TD.index_add(0, rows_N, out_ND * weights_TK[rows_N, slot_N].unsqueeze(-1))
        return y_TD


def shard_experts(layers: list[Any], mesh: Any, lora_outside: bool,
                  weights_of: Callable[[int], dict[str, torch.Tensor]],
                  before_unshard: Callable[[int, int], Callable[..., None]] | None = None,
                  ) -> None:
    """``fully_shard`` every expert (LoRA included); the layers themselves are not sharded.

    With ``lora_outside`` the adapters are added after wrapping: the wrapping-order mistake.
    FSDP averages gradients over ranks; the worker scales each rank's loss share by the world
    size so the result is the global gradient (gloo has no PREMUL_SUM for a divide factor).
    """
    from torch.distributed.fsdp import fully_shard

    for li, layer in enumerate(layers):
        for e, expert in enumerate(layer.experts.experts):
            fully_shard(expert, mesh=mesh)
            if before_unshard is not None:
                # prepended after fully_shard, so it runs before FSDP's own pre-forward hook
                # and sees the sequence number the expert's all-gather is about to get
                expert.register_forward_pre_hook(before_unshard(li, e), prepend=True)
    if lora_outside:
        for li, layer in enumerate(layers):
            weights = weights_of(li)
            for e, expert in enumerate(layer.experts.experts):
                expert.add_lora(weights, e)


def uncovered_trainable(model: nn.Module) -> list[str]:
    """Trainable parameters FSDP does not manage (not DTensors): no gradient reduction."""
    from torch.distributed.tensor import DTensor

    return [name for name, p in model.named_parameters()
            if p.requires_grad and not isinstance(p, DTensor)]
