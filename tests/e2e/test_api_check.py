"""``moe_hang.check(build, batch)`` and the ``moe_hang_check`` fixture on a plain-torch MoE
block (FSDP2 per expert): the model as commonly written fails the test with the diagnosis;
the fixed one passes (tests/e2e/test_user_moe_invariant.py is the same on transformers)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import moe_hang
from moe_hang.errors import MoeHangError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
DIM, EXPERTS, TOKENS = 16, 4, 32


class Block(torch.nn.Module):
    def __init__(self, every_expert: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.top_k, self.every_expert = 2, every_expert

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        w_tk, chosen_tk = self.gate(x_td).softmax(-1).topk(self.top_k, dim=-1)
        out_td = x_td
        for e, expert in enumerate(self.experts):
            token_n, slot_n = torch.where(chosen_tk == e)
            if token_n.numel() or self.every_expert:
                out_td = out_td.index_add(0, token_n, expert(x_td[token_n])
                                          * w_tk[token_n, slot_n, None])
        return out_td


def _build(every_expert: bool) -> Block:
    torch.manual_seed(0)
    block = Block(every_expert)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for expert in block.experts:
        fully_shard(expert, mesh=mesh)
    return fully_shard(block, mesh=mesh)


def build_fixed() -> Block:
    return _build(every_expert=True)


def build_skipping() -> Block:
    return _build(every_expert=False)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def test_check_passes_the_fixed_block_and_fails_the_skipping_one(moe_hang_check):
    result = moe_hang_check(build_fixed, batch, world=2, plans=1)
    assert [(r.plan.name if r.plan else None, r.verdict, r.planned)
            for r in result.results] == [("starve-e0-r1", "healthy", True)]
    with pytest.raises(moe_hang.HangReproduced) as caught:
        moe_hang_check(build_skipping, batch, world=2, plans=1)
    assert "REPRODUCED by 1 of 1 plans" in str(caught.value)
    assert "rank 1 routed 0 of 32 tokens to Block expert 0 at step 1" in str(caught.value)
    assert caught.value.result.exit_code == 3


def test_check_refuses_what_the_ranks_cannot_import() -> None:
    def local_build() -> Block:
        return _build(True)

    with pytest.raises(MoeHangError, match="module-level function"):
        moe_hang.check(local_build, batch)
    with pytest.raises(MoeHangError, match="at least 2 ranks"):
        moe_hang.check(build_fixed, batch, world=1)

    class LocalRouter(torch.nn.Module):
        pass

    with pytest.raises(MoeHangError, match="importable module"):
        moe_hang.check(build_fixed, batch, router=LocalRouter)
