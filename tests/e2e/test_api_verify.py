"""``moe_hang.check(build, batch, reference=...)``: verify's proof on the user's own code. Every
clean run (the baseline and each routing plan) is compared, step by step, with the same model
in one process, every expert local, under the same plan: outputs, losses and the whole
gradient of every parameter the optimizer steps.

A plain-torch MoE block (FSDP2 per expert) whose fix is right matches; a "fix" that runs an
expert with no token on a dummy row and lets its output leak into the result hangs no more,
but differs from the reference exactly under the plans that starve an expert. Where installed
(make corpus-deps), the fixed code of transformers' Mixtral + peft + FSDP2 and of NeMo
Automodel's ``GroupedExpertsLoRA`` (0.7.0, expert parallel) match their references."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import moe_hang
from moe_hang.errors import MoeHangError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
DIM, EXPERTS, TOKENS = 16, 4, 32
HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))
NEMO = Path(__file__).resolve().parents[2] / ".venv" / "corpus" / "nemo-automodel-0.7.0"


class Block(torch.nn.Module):
    """``mode``: "skip" calls only the experts that got a token (as commonly written: right in
    one process, a hang under FSDP per expert), "every" all of them (the fix), "leak" runs an
    expert that got none on a zero row and adds a share of its output to every token."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.top_k, self.mode = 2, mode

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        w_tk, chosen_tk = self.gate(x_td).softmax(-1).topk(self.top_k, dim=-1)
        out_td = x_td
        for e, expert in enumerate(self.experts):
            token_n, slot_n = torch.where(chosen_tk == e)
            if token_n.numel() or self.mode == "every":
                out_td = out_td.index_add(0, token_n, expert(x_td[token_n])
                                          * w_tk[token_n, slot_n, None])
            elif self.mode == "leak":
                out_td = out_td + 0.01 * expert(torch.zeros(1, DIM)).sum()
        return out_td


def _sharded(mode: str) -> Block:
    block = Block(mode)  # moe_hang seeds torch before build() and reference() alike
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for expert in block.experts:
        fully_shard(expert, mesh=mesh)
    return fully_shard(block, mesh=mesh)


def build_fixed() -> Block:
    return _sharded("every")


def build_leaky() -> Block:
    return _sharded("leak")


def reference() -> Block:
    return Block("skip")  # the model's own math, in one process


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def test_the_fix_matches_the_single_process_reference_under_every_plan(moe_hang_check):
    result = moe_hang_check(build_fixed, batch, reference=reference, world=2, plans=2)
    assert result.compared and result.exit_code == 0
    assert [r.verdict for r in result.runs] == ["healthy"] * 3
    for r in result.runs:
        assert r.reference is not None and r.reference.ok, r.reference
        # 3 steps x 2 ranks x (output, loss, the gate's and 4 experts' weight and bias)
        assert r.reference.compared == 3 * 2 * (2 + 1 + 2 * EXPERTS)
    saved = json.loads((result.run_dir / "check.json").read_text())
    assert saved["compared"] and saved["differs"] == 0
    assert all(p["reference"]["ok"] for p in saved["plans"])


def test_a_fix_that_changes_the_math_differs_where_an_expert_got_no_token(moe_hang_check):
    with pytest.raises(moe_hang.ReferenceMismatch) as caught:
        moe_hang_check(build_leaky, batch, reference=reference, world=2, plans=2)
    res = caught.value.result
    assert not res.reproduced  # no hang: every step finished
    assert [(r.plan.name if r.plan else None, r.differs) for r in res.runs] == [
        (None, False), ("starve-e0-r1", True), ("starve-e0-r0", True)]
    assert res.exit_code == 4
    # the earliest difference: the planned rank's output at the planned step
    assert res.results[0].reference.failures[0].startswith("step 1 rank 1 output")
    assert res.results[1].reference.failures[0].startswith("step 1 rank 0 output")
    message = str(caught.value)
    assert "DIFFERS from the single-process reference in 2 of 3 runs" in message
    assert "starve-e0-r1: every step finished, not as the single-process reference" in message


def test_the_reference_may_be_build_itself_on_one_rank(moe_hang_check):
    result = moe_hang_check(build_fixed, batch, reference=build_fixed, world=2, plans=1)
    assert [r.reference.ok for r in result.runs if r.reference] == [True, True]


def test_verify_refuses_bad_input_before_starting_anything(tmp_path) -> None:
    def local_reference() -> Block:
        return Block("skip")

    with pytest.raises(MoeHangError, match="reference: give a module-level function"):
        moe_hang.check(build_fixed, batch, reference=local_reference, out=tmp_path / "a")
    with pytest.raises(MoeHangError, match="reduce="):
        moe_hang.check(build_fixed, batch, reference=reference, reduce="avg",
                       out=tmp_path / "b")
    with pytest.raises(MoeHangError, match="rtol="):
        moe_hang.check(build_fixed, batch, reference=reference, rtol=0, out=tmp_path / "c")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------ transformers' Mixtral + peft + FSDP2
VOCAB, SEQ = 64, 16


def _mixtral(fixed: bool, shard: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig
    from transformers.models.mixtral import modeling_mixtral

    sys.path.insert(0, str(Path(__file__).parent / "jobs"))
    from hf_moe_train import every_expert_forward

    if fixed:
        modeling_mixtral.MixtralSparseMoeBlock.forward = every_expert_forward
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, router_jitter_noise=0.0)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["w1", "w2", "w3"]))
    if shard:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in base.model.layers:
            for expert in layer.block_sparse_moe.experts:
                fully_shard(expert, mesh=mesh)
        fully_shard(base, mesh=mesh)
    return model


def build_mixtral_fixed():
    return _mixtral(fixed=True, shard=True)


def reference_mixtral():
    return _mixtral(fixed=False, shard=False)  # as transformers ships it: right in one process


def mixtral_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(
        100 * step + rank))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.skipif(not HF, reason="transformers + peft not installed (make corpus-deps)")
def test_transformers_mixtral_peft_fsdp2_fixed_matches_its_reference(moe_hang_check):
    result = moe_hang_check(build_mixtral_fixed, mixtral_batch, reference=reference_mixtral,
                            world=2, plans=2)
    assert [r.verdict for r in result.runs] == ["healthy"] * 3
    assert all(r.planned for r in result.results)
    for r in result.runs:
        assert r.reference is not None and r.reference.ok, r.reference.failures
        assert r.reference.compared > 3 * 2 * 2  # the LoRA weights of every expert too


# ------------------------------------------------ NeMo Automodel's GroupedExpertsLoRA (EP)
def _nemo_block(ep: bool):
    sys.path.insert(0, str(Path(__file__).parent / "jobs"))
    from automodel_train import DIM as NEMO_DIM
    from automodel_train import EXPERTS as NEMO_EXPERTS
    from automodel_train import TOPK, MoEBlock
    from nemo_automodel.components.moe.config import MoEConfig

    config = MoEConfig(
        n_routed_experts=NEMO_EXPERTS, n_shared_experts=0, n_activated_experts=TOPK,
        n_expert_groups=1, n_limited_groups=1, train_gate=False, gate_bias_update_factor=0.0,
        aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0, dim=NEMO_DIM, inter_dim=128,
        moe_inter_dim=32, norm_topk_prob=True, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),),
                            mesh_dim_names=("ep",)) if ep else None
    model = MoEBlock(config, mesh)
    opt = torch.optim.SGD([p for p in model.experts.parameters() if p.requires_grad], lr=0.1)
    return model, opt


def build_nemo() -> tuple:
    return _nemo_block(ep=True)


def reference_nemo() -> tuple:
    return _nemo_block(ep=False)


def nemo_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(100 * step + rank))


@pytest.mark.skipif(not NEMO.is_dir(), reason="nemo-automodel 0.7.0 not installed "
                    "(make corpus-deps)")
def test_nemo_automodel_0_7_0_matches_its_reference_expert_parallel(moe_hang_check,
                                                                    monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(NEMO))
    monkeypatch.syspath_prepend(str(NEMO))
    result = moe_hang_check(build_nemo, nemo_batch, reference=reference_nemo, world=2,
                            plans=4, reduce="sum")
    assert [r.plan.name for r in result.results] == [
        "starve-e0-r1", "starve-e0-r0", "ragged-r1", "no-token-r1"]
    assert [r.verdict for r in result.runs] == ["healthy"] * 5
    *matched, no_token = result.runs
    for r in matched:
        assert r.reference is not None and r.reference.ok, r.reference
    # 0.7.0's own layer, all experts local, cannot take a batch of no token (the distributed
    # run could: the ranks' tokens are gathered first): that run is said to be uncompared,
    # neither a match nor a difference
    assert no_token.uncompared and not no_token.differs
    assert no_token.reference.error.startswith("on rank 1's batch at step 1: IndexError")
    assert result.exit_code == 0 and [r.plan.name for r in result.uncompared] == [
        "no-token-r1"]
