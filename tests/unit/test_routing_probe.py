"""The probe's router counting and routing plans (probe/routing.py), in one process on real
modules: a plain torch MoE block, routers that return logits or indices, transformers' own
MoE blocks where installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from moe_hang.evidence.routing import read_routing
from moe_hang.probe import routing
from moe_hang.probe.routing import Plan, Routing

E, K, D, T = 4, 2, 8, 12


class Block(torch.nn.Module):
    """An MoE block as users write them: a gate linear, experts called only where routed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D, E, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(E))
        self.top_k = K
        self.called: list[int] = []

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        chosen_tk = self.gate(x_td).topk(K, dim=-1).indices
        out_td = torch.zeros_like(x_td)
        self.called = []
        for e in range(E):
            rows = (chosen_tk == e).any(dim=-1).nonzero().flatten()
            if rows.numel():
                self.called.append(e)
                out_td[rows] += self.experts[e](x_td[rows])
        return out_td


class IndexRouter(torch.nn.Module):
    """A router that chose already: (weights, indices), as DeepSeek-V3's and NeMo's do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, E, bias=False)
        self.topk = K

    def forward(self, x_td: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_tk, idx_tk = self.proj(x_td).softmax(-1).topk(K, dim=-1)
        return w_tk, idx_tk


class IndexBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = IndexRouter()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(E))
        self.last_idx: torch.Tensor | None = None

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        _, idx_tk = self.router(x_td)
        self.last_idx = idx_tk
        return x_td


class Model(torch.nn.Module):
    def __init__(self, block: type[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([block(), block()])

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_td = layer(x_td)
        return x_td


def _train(model: torch.nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(steps):
        model(torch.randn(T, D)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def counted(tmp_path: Path):
    made: list[Routing] = []

    def make(plan: Plan | None = None, router_class: str | None = None) -> Routing:
        r = Routing(torch, 1, tmp_path / "rank1.routing.jsonl", plan, router_class)
        r.install()
        made.append(r)
        return r

    yield make
    for r in made:  # every hook goes with the test, even when it failed before a step
        r.remove()


def test_counts_every_block_per_step(counted, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Model(Block)
    r = counted()
    _train(model, 3)
    got = read_routing(r.path)
    calls, bad = got.calls, got.bad
    assert bad == 0 and r.broken is None and not got.compiled
    assert [(c.step, c.block) for c in calls] == [
        (s, f"layers.{i}") for s in range(3) for i in range(2)]
    assert all(sum(c.counts) == T * K and c.tokens == T and len(c.counts) == E
               for c in calls)
    assert r._global is None  # the global hook went at the first step


def test_the_file_is_bounded_and_keeps_the_plan_and_the_last_step(counted, monkeypatch
                                                                  ) -> None:
    monkeypatch.setattr(routing, "MAX_BYTES", 600)  # about four lines
    torch.manual_seed(0)
    model = Model(Block)
    r = counted(Plan(rank=1, step=1, starve=0))
    _train(model, 6)
    calls = read_routing(r.path).calls
    assert r.path.stat().st_size < 1500
    assert [c.step for c in calls if c.planned] == [1, 1]
    assert {c.step for c in calls if not c.planned} <= {4, 5}


def test_starve_plan_reaches_the_model_on_its_rank_and_step_only(counted) -> None:
    torch.manual_seed(0)
    model = Model(Block)
    r = counted(Plan(rank=1, step=1, starve=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[list[int]] = []
    for _ in range(3):
        model(torch.randn(T, D)).sum().backward()
        seen.append(model.layers[0].called)
        opt.step()
        opt.zero_grad()
    assert 2 not in seen[1] and 2 in seen[0] and 2 in seen[2]
    calls = read_routing(r.path).calls
    planned = [c for c in calls if c.planned]
    assert [c.step for c in planned] == [1, 1]  # kept after the step: proof it was applied
    assert all(c.counts[2] == 0 for c in planned)


def test_a_plan_for_another_rank_changes_nothing(counted) -> None:
    torch.manual_seed(0)
    model = Model(Block)
    r = counted(Plan(rank=0, step=0, starve=1))
    _train(model, 1)
    calls = read_routing(r.path).calls
    assert calls and not any(c.planned for c in calls)


def test_index_router_rerouted_without_duplicates(counted) -> None:
    torch.manual_seed(0)
    model = Model(IndexBlock)
    counted(Plan(rank=1, step=0, starve=0))
    model(torch.randn(T, D))
    idx = model.layers[0].last_idx
    assert idx is not None and not (idx == 0).any()
    assert all(len(set(row.tolist())) == K for row in idx)  # still K distinct experts


def test_all_to_plan_gives_every_token_that_expert(counted) -> None:
    torch.manual_seed(0)
    model = Model(IndexBlock)
    r = counted(Plan(rank=1, step=0, all_to=3))
    model(torch.randn(T, D))
    idx = model.layers[1].last_idx
    assert idx is not None and bool((idx == 3).any(dim=1).all())
    calls = read_routing(r.path).calls
    assert all(c.counts[3] == T for c in calls)


def test_a_named_router_class(counted) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(IndexRouter())
    r = counted(router_class=f"{IndexRouter.__module__}.IndexRouter")
    model(torch.randn(T, D))
    calls = read_routing(r.path).calls
    assert len(calls) == 1 and calls[0].block == "0" and sum(calls[0].counts) == T * K


def test_an_unreadable_router_output_stops_counting_never_the_job(counted) -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Identity()
            self.experts = torch.nn.ModuleList([torch.nn.Identity()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate({"not": x})["not"]  # a dict: neither logits nor indices

    r = counted()
    out = Odd()(torch.ones(2))
    assert torch.equal(out, torch.ones(2)) and r.broken is not None


def test_plan_from_env_and_off_switch(tmp_path: Path) -> None:
    env = {routing.ENV_PLAN: json.dumps({"rank": 1, "step": 2, "starve": 3})}
    assert Plan.from_env(env) == Plan(1, 2, starve=3)
    assert routing.install(torch, 0, tmp_path / "x", {routing.ENV_OFF: "0"}) is None


HF = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not HF, reason="transformers not installed (make corpus-deps)")
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_transformers_moe_blocks_found_counted_and_starved(counted, arch: str) -> None:
    import transformers as tf

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2)
    cfg = {
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=E, **small),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(num_experts=E, moe_intermediate_size=16,
                                               shared_expert_intermediate_size=16, **small),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            n_routed_experts=E, moe_intermediate_size=16, first_k_dense_replace=0, n_group=1,
            topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4, **{**small, "num_key_value_heads": 2}),
        "gpt_oss": lambda: tf.GptOssConfig(num_local_experts=E, head_dim=8, **small),
    }[arch]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    r = counted(Plan(rank=1, step=1, starve=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        ids = torch.randint(0, 64, (1, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    calls = read_routing(r.path).calls
    assert r.broken is None
    assert {c.block for c in calls} == {f"model.layers.{i}.{m}" for i in range(2) for m in (
        ["block_sparse_moe"] if arch == "mixtral" else ["mlp"])}
    step1 = [c for c in calls if c.step == 1]
    assert step1 and all(c.planned and c.counts[2] == 0 and sum(c.counts) == 32
                         for c in step1)


@pytest.mark.parametrize("keep", [0.25, 0.0])  # ragged counts, and a rank with no token
def test_keep_plan_cuts_the_blocks_input_and_pads_its_output(counted, keep: float) -> None:
    torch.manual_seed(0)
    model = Model(Block)
    r = counted(Plan(rank=1, step=0, keep=keep))
    x = torch.randn(T, D, requires_grad=True)
    y = model(x)
    assert y.shape == (T, D)  # the rest of the model sees the shape it expects
    y.sum().backward()  # the rows the block did not get pass through: the gradient too
    assert x.grad is not None and bool((x.grad[int(T * keep):] != 0).all())
    calls = read_routing(r.path).calls
    assert [c.tokens for c in calls] == [int(T * keep)] * 2 and all(c.planned for c in calls)
    assert all(sum(c.counts) == int(T * keep) * K for c in calls)


def test_an_eager_model_without_a_router_is_not_marked_compiled(counted) -> None:
    """The mark needs dynamo to have compiled something: an eager job with no router is
    "no router" (name one), not "compiled"."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, D))
    r = counted()
    _train(model, 2)
    got = read_routing(r.path)
    assert got.calls == [] and not got.compiled and r.broken is None


def test_a_compiled_model_gets_no_graph_break_from_the_hooks(counted) -> None:
    """torch.compile traces module hooks: ours do nothing while it traces (before, they broke
    this model into 7 graphs). Its routers go uncounted."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Model(IndexBlock)
    r = counted()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        compiled(torch.randn(T, D, requires_grad=True)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert sum(counters["graph_break"].values()) == 0 and r.broken is None
    # no router seen, and dynamo compiled frames: the file says so (check's "compiled")
    got = read_routing(r.path)
    assert got.calls == [] and got.compiled and got.bad == 0
    torch._dynamo.reset()
    counters.clear()  # process-wide: a later test's eager model must not read as compiled


class FusedExperts(torch.nn.Module):
    """Every expert's weights in one 3-D parameter, as transformers 5's and NeMo's are."""

    def __init__(self) -> None:
        super().__init__()
        self.w_edd = torch.nn.Parameter(torch.randn(E, D, D) * 0.1)

    def forward(self, x_td: torch.Tensor, chosen_tk: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,tde->te", x_td, self.w_edd[chosen_tk[:, 0]])


class FusedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D, E, bias=False)
        self.experts = FusedExperts()
        self.top_k = K

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        return self.experts(x_td, self.gate(x_td).topk(K, dim=-1).indices)


def test_fused_experts_are_told_from_one_module_each(counted) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(FusedBlock(), Block())
    r = counted()
    _train(model, 2)
    calls = read_routing(r.path).calls
    assert {(c.block, c.fused) for c in calls} == {("0", True), ("1", False)}
    assert all(len(c.counts) == E for c in calls)  # the count from the router's width


def test_remove_takes_every_hook_off(counted) -> None:
    torch.manual_seed(0)
    model = Model(Block)
    r = counted(Plan(rank=1, step=0, keep=0.5))
    _train(model, 1)
    lines = r.path.read_bytes()
    r.remove()
    _train(model, 2)
    assert r.path.read_bytes() == lines and r.step == 1  # no count, no step, no cut
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


TORCHTITAN = Path(__file__).resolve().parents[2] / ".venv" / "corpus" / "torchtitan-0.2.2"


def _torchtitan_moe(monkeypatch: pytest.MonkeyPatch) -> object:
    """torchtitan 0.2.2's ``models/moe/moe.py``, its own file, loaded by path: the package
    around it imports triton (its grouped-mm kernels), tyro and its config at import, none of
    which a CPU machine has or this module uses with ``use_grouped_mm=False``; the three
    names it imports are given as what they are (a truncated-normal init, a logger, a
    wrapper only the grouped-mm path calls)."""
    import importlib.util
    import logging
    import sys
    import types

    def module(name: str, **attrs: object) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for pkg in ("torchtitan", "torchtitan.models", "torchtitan.models.moe", "torchtitan.tools"):
        module(pkg, __path__=[])
    module("torchtitan.models.utils", trunc_normal_=torch.nn.init.trunc_normal_)
    module("torchtitan.tools.logging", logger=logging.getLogger("torchtitan"))
    module("torchtitan.models.moe.utils", indices_padding_wrapper=lambda fn: fn)
    # its router and reorderer histogram the chosen experts (int64) with torch.histc, which
    # CUDA has for integers (an integer histogram back) and the CPU does not: the same
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, *a, **k: histc(t, *a, **k)
                        if t.is_floating_point() else histc(t.float(), *a, **k).to(t.dtype))
    path = TORCHTITAN / "torchtitan" / "models" / "moe" / "moe.py"
    spec = importlib.util.spec_from_file_location("torchtitan.models.moe.moe", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not TORCHTITAN.is_dir(), reason="torchtitan 0.2.2 not unpacked "
                    "(make corpus-deps)")
def test_torchtitan_moe_counted_as_its_own_router_counts_and_starved(
        counted, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's MoE (TokenChoiceTopKRouter: sigmoid scores, an expert bias, returning
    scores, the chosen experts [tokens, k] and tokens per expert; GroupedExperts: every
    expert's weights in 3-D parameters): the probe's counts are the ones torchtitan keeps
    itself (``tokens_per_expert``, its own histogram), the block is fused, and a plan that
    starves an expert reaches the experts' split (their ``num_tokens_per_expert``)."""
    tt = _torchtitan_moe(monkeypatch)
    args = tt.MoEArgs(num_experts=E, num_shared_experts=1, top_k=K,  # type: ignore[attr-defined]
                      use_grouped_mm=False, load_balance_coeff=1e-3)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                tt.MoE(args, dim=D, hidden_dim=2 * D) for _ in range(2))  # type: ignore[attr-defined]
            for layer in self.layers:
                layer.init_weights(0.02, torch.device("cpu"))

        def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x_bsd = layer(x_bsd)
            return x_bsd

    torch.manual_seed(0)
    net = Net()
    r = counted()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    net(torch.randn(2, T // 2, D)).sum().backward()
    opt.step()
    calls = read_routing(r.path).calls
    assert r.broken is None and [c.block for c in calls] == ["layers.0", "layers.1"]
    for c, layer in zip(calls, net.layers, strict=True):
        assert list(c.counts) == [int(n) for n in layer.tokens_per_expert.tolist()], c
        assert c.tokens == T and c.top_k == K and c.fused
    r.remove()

    split: list[list[int]] = []
    net.layers[0].experts.register_forward_hook(
        lambda _m, args, _o: split.append([int(n) for n in args[1]]))
    r = counted(Plan(rank=1, step=0, starve=1))
    net(torch.randn(2, T // 2, D)).sum().backward()
    assert r.broken is None and split and split[0][1] == 0 and sum(split[0]) == T * K, split
    assert read_routing(r.path).calls[0].planned
