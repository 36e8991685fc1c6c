"""The write-up's third layer of defence, as a test in a user's own CI: every MoE layer's
forward runs on every rank, even where a rank routed it no token. Copy this file, and change
``build_*`` and ``batch`` to your model (sharded as you shard it) and your data: moe-hang runs
it on 2 gloo ranks under its routing plans (an expert starved on one rank, then on the other)
and the test fails with the diagnosis when a plan makes it hang.

Here the model is transformers' own Mixtral MoE block, each expert its own FSDP2 unit: as
transformers 4.57 ships it (experts with no token are not called, so their all-gather is never
posted: it hangs), and with the fix (every expert called, on zero rows where it got none)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from moe_hang import HangReproduced

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
HIDDEN, TOKENS = 16, 32


def every_expert_forward(self: MixtralSparseMoeBlock, hidden_btd: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fix: the block's forward with every expert called (zero rows where it got none)."""
    b, t, d = hidden_btd.shape
    x_td = hidden_btd.reshape(-1, d)
    logits_te = self.gate(x_td)
    w_tk, chosen_tk = torch.topk(F.softmax(logits_te, dim=1, dtype=torch.float), self.top_k,
                                 dim=-1)
    w_tk = (w_tk / w_tk.sum(dim=-1, keepdim=True)).to(x_td.dtype)
    out_td = torch.zeros_like(x_td)
    for e, expert in enumerate(self.experts):
        token_n, slot_n = torch.where(chosen_tk == e)
        out_td.index_add_(0, token_n, expert(x_td[token_n]) * w_tk[token_n, slot_n, None])
    return out_td.reshape(b, t, d), logits_te


def _block() -> MixtralSparseMoeBlock:
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for expert in block.experts:
        fully_shard(expert, mesh=mesh)
    fully_shard(block, mesh=mesh)
    return block


def build_as_shipped() -> MixtralSparseMoeBlock:
    return _block()


def build_fixed() -> MixtralSparseMoeBlock:
    block = _block()
    block.forward = types.MethodType(every_expert_forward, block)  # type: ignore[method-assign]
    return block


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(1, TOKENS, HIDDEN, generator=g)


def test_every_rank_calls_every_expert(moe_hang_check):
    result = moe_hang_check(build_fixed, batch, world=2, steps=3, plans=2)
    assert [r.verdict for r in result.results] == ["healthy", "healthy"]
    assert all(r.planned for r in result.results)  # the plans were applied, and ran clean


def test_the_block_as_shipped_hangs_when_a_rank_starves_an_expert(moe_hang_check):
    with pytest.raises(HangReproduced) as caught:
        moe_hang_check(build_as_shipped, batch, world=2, steps=3, plans=2)
    message = str(caught.value)
    assert "REPRODUCED by 2 of 2 plans" in message
    assert "routed 0 of 32 tokens to MixtralSparseMoeBlock expert 0" in message or \
        "expert 0 at step 1" in message
