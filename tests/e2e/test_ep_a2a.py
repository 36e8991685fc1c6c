"""The all-to-all dispatcher at real gloo ranks against the single-process reference,
including a rank with no token, an expert no token reaches, and experts without LoRA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks
from torch import nn

from moe_hang.config import ModelConfig
from moe_hang.scenarios.a2a import AllToAllDispatch
from moe_hang.scenarios.moe import GroupedExpertsLoRA, Router, layer_weights

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


class PlainExperts(nn.Module):
    """Frozen experts without adapters (y = tanh(x W_e)): the dispatcher alone moves gradient."""

    def __init__(self, w_EDD: torch.Tensor, first: int, num_local: int):
        super().__init__()
        self.first, self.num_local = first, num_local
        self.w_LDD = nn.Parameter(w_EDD[first:first + num_local].clone(), requires_grad=False)

    def forward(self, x_GD, weights_GK, experts_GK):
        y = torch.zeros_like(x_GD)
        for j in range(self.num_local):
            rows, slot = (experts_GK == self.first + j).nonzero(as_tuple=True)
            y = y.index_add(0, rows, torch.tanh(x_GD[rows] @ self.w_LDD[j])
                            * weights_GK[rows, slot].unsqueeze(-1))
        return y


def _case(counts, topk, dead, lora):
    cfg = ModelConfig(hidden=16, ffn=32, experts=4, topk=topk, lora_rank=4, dead_experts=dead)
    g = torch.Generator().manual_seed(7)
    X = torch.randn(sum(counts), cfg.hidden, generator=g, dtype=torch.float64)
    C = torch.randn(sum(counts), cfg.hidden, generator=g, dtype=torch.float64)
    W = {k: v.double() for k, v in layer_weights(cfg, 0).items()}
    plain = torch.randn(cfg.experts, cfg.hidden, cfg.hidden, generator=g, dtype=torch.float64)
    return cfg, X, C, W, plain


def _experts(cfg, W, plain, first, num, lora):
    if lora:
        return GroupedExpertsLoRA(W, first, num, cfg.lora_scale)
    return PlainExperts(plain * 0.3, first, num)


def _worker(rank, world, counts, topk, dead, lora):
    cfg, X, C, W, plain = _case(counts, topk, dead, lora)
    router = Router(W["router_DE"], topk, tuple(dead))
    off = sum(counts[:rank])
    rows = slice(off, off + counts[rank])
    num = cfg.experts // world
    experts = _experts(cfg, W, plain, rank * num, num, lora)
    x_TD = X[rows].clone().requires_grad_(True)
    weights_TK, experts_TK = router(x_TD)
    y_TD = AllToAllDispatch(dist.group.WORLD, num)(x_TD, weights_TK, experts_TK, experts)
    (y_TD * C[rows]).sum().backward()

    # reference: one process, all experts local, the whole batch
    ref_experts = _experts(cfg, W, plain, 0, cfg.experts, lora)
    Xr = X.clone().requires_grad_(True)
    wr, er = router(Xr)
    Yr = ref_experts(Xr, wr, er)
    (Yr * C).sum().backward()
    assert torch.allclose(y_TD.detach(), Yr.detach()[rows], atol=1e-12)
    assert torch.allclose(x_TD.grad, Xr.grad[rows], atol=1e-12)
    if lora:
        for name, p in experts.lora_params().items():
            ref_g = getattr(ref_experts, name).grad[rank * num:(rank + 1) * num]
            got = p.grad if p.grad is not None else torch.zeros_like(ref_g)
            assert torch.allclose(got, ref_g, atol=1e-12), name


@pytest.mark.parametrize("counts,topk,dead,lora", [
    ((3, 5), 2, (), True),
    ((0, 5), 2, (), True),     # a rank with no token at all
    ((4, 4), 2, (3,), True),   # an expert (on rank 1) no token reaches
    ((6, 2), 1, (2, 3), True), # rank 1's experts receive nothing (top-1)
    ((0, 5), 2, (), False),    # without LoRA: gradient reaches x through both all-to-alls
    ((5, 3), 1, (), False),
])
def test_a2a_matches_reference(tmp_path, counts, topk, dead, lora):
    spawn_ranks(_worker, (counts, topk, dead, lora), tmp_path)
