"""The scenario matrix through the CLI: each broken variant reproduces with the right verdict
and call site; each fix verifies against the single-process reference."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, assert_no_survivors, by_rank, line_of, run_cli

from moe_hang.config import build_config
from moe_hang.scenarios.moe import (
    build_reference_model,
    global_batch,
    local_loss,
    tokens_per_expert,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _cli(tmp_path, *args: str) -> tuple[int, dict]:
    run = tmp_path / "run"
    proc = run_cli(*args, "--out", str(run), "--json", timeout=200)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert_no_survivors(str(run))
    return proc.returncode, json.loads(proc.stdout)


def test_ep_no_anchor_desyncs_in_backward(tmp_path):
    code, d = _cli(tmp_path, "repro", "--scenario", "ep-no-anchor")
    assert code == 3 and d["verdict"] == "desync"
    fd = d["first_divergence"]
    assert fd["phase"] == "backward"
    r = by_rank(d)
    # rank 0 runs the gather's backward all-reduce; rank 1's graph lacks it (no anchor)
    assert r[0]["phase"] == "backward" and r[0]["autograd_function"] == "_GatherVarlen"
    assert r[0]["callsite"]["function"] == "sum_gathered_grads"
    assert r[0]["callsite"]["line"] == line_of(ROOT / "moe_hang" / "scenarios" / "ep.py",
                                               "dist.all_reduce(grad_GX, group=group)")
    assert "backward" in d["summary"] and "anchor" in d["fix_hint"]


def test_fsdp_skip_names_the_skipped_expert(tmp_path):
    code, d = _cli(tmp_path, "repro", "--scenario", "fsdp-skip")
    assert code == 3 and d["verdict"] == "desync" and d["culprit_ranks"] == [0]
    fd = d["first_divergence"]
    assert fd["kind"] == "missing_rank"
    assert fd["per_rank"]["1"]["tag"] == "layer1.expert2"  # what rank 0 never gathered
    assert fd["per_rank"]["0"] is None  # aligned by what was posted: rank 0 lacks that gather
    r = by_rank(d)
    assert r[0]["tokens"]["per_expert"][2] == 0 and r[0]["tokens"]["step"] == 5
    assert r[1]["callsite"]["file"].endswith("moe_hang/scenarios/fsdp.py")
    assert "never posted the all_gather of layer1.expert2" in d["summary"]


@pytest.mark.parametrize("args", [
    ("--fix", "a2a"),
    ("--scenario", "ep-no-anchor"),
    ("--scenario", "ep-no-anchor", "--fix", "a2a"),
    ("--scenario", "fsdp-skip"),
])
def test_each_fix_verifies(tmp_path, args):
    code, d = _cli(tmp_path, "verify", "--fixed", *args)
    assert code == 0, d["summary"]
    assert d["verified"] is True and d["reference"]["ok"]
    assert d["reference"]["max_abs_err"] <= d["reference"]["tolerance"]


def test_lora_outside_fully_shard_fails_verify_by_name(tmp_path):
    code, d = _cli(tmp_path, "verify", "--fixed", "--scenario", "fsdp-skip",
                   "--lora-outside-fsdp", "--steps", "2")
    assert code == 4 and d["verified"] is False
    assert "outside fully_shard" in d["summary"]
    assert "layers.0.experts.experts.0.lora_gate_up_A" in d["uncovered_trainable"]


def test_a2a_at_three_ranks_top1_with_an_empty_rank(tmp_path):
    code, d = _cli(tmp_path, "verify", "--fixed", "--fix", "a2a", "--tokens", "40,0,23",
                   "--topk", "1", "--steps", "2")
    assert code == 0, d["summary"]


def test_a2a_is_recommended_when_experts_per_token_is_large(tmp_path):
    code, d = _cli(tmp_path, "repro", "--nproc", "4")  # E = 8, top-2: E/k = 4
    assert code == 3 and d["recommended_fix"] == "a2a"
    assert "--fix a2a" in d["fix_hint"] and "E/k = 8/2" in d["fix_hint"]


def test_varlen_at_four_ranks_with_eight_experts(tmp_path):
    code, d = _cli(tmp_path, "verify", "--fixed", "--nproc", "4", "--experts", "8",
                   "--steps", "2")
    assert code == 0, d["summary"]


def test_fsdp_default_batch_routes_nothing_to_one_expert_only_at_step_5():
    """The scenario's story: 4 clean steps, then rank 0 routes no token to layer-1 expert 2."""
    cfg = build_config(scenario="fsdp-skip")
    mcfg = cfg.model
    model = build_reference_model(mcfg)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    routed: dict[int, torch.Tensor] = {}

    def hook(layer: int):
        def fn(_m, _i, out):
            routed[layer] = out[1][: cfg.tokens[0]]
        return fn

    for i, layer in enumerate(model.layers):
        layer.router.register_forward_hook(hook(i))
    for step in range(1, cfg.steps + 1):
        out = model(global_batch(mcfg, cfg.total_tokens, step))
        local_loss(out, cfg.total_tokens).backward()
        opt.step()
        opt.zero_grad()
        zero = [(li, e) for li, t in routed.items()
                for e, n in enumerate(tokens_per_expert(t, cfg.model.experts)) if n == 0]
        assert zero == ([] if step < 5 else [(1, 2)]), (step, zero)


# ----------------------------------------------------------------------------- full matrix


MATRIX = [
    (world, fix, topk, tokens)
    for world, tokens_list in ((2, ["68,401", "0,37"]), (3, ["68,401,1607", "12,0,40"]),
                               (4, ["68,401,1607,230", "9,0,33,5"]))
    for fix in ("varlen", "a2a")
    for topk in (1, 2)
    for tokens in tokens_list
]


@pytest.mark.matrix
@pytest.mark.parametrize("world,fix,topk,tokens", MATRIX)
def test_matrix_fix_verifies(tmp_path, world, fix, topk, tokens):
    code, d = _cli(tmp_path, "verify", "--fixed", "--fix", fix, "--nproc", str(world),
                   "--tokens", tokens, "--topk", str(topk), "--experts", str(2 * world),
                   "--steps", "2")
    assert code == 0, d["summary"]


@pytest.mark.matrix
@pytest.mark.parametrize("scenario,world", [(s, w) for s in ("ep-ragged", "ep-no-anchor",
                                                             "fsdp-skip") for w in (2, 3, 4)])
def test_matrix_broken_reproduces(tmp_path, scenario, world):
    code, d = _cli(tmp_path, "repro", "--scenario", scenario, "--nproc", str(world))
    assert code == 3 and d["verdict"] == "desync", d["summary"]
