"""NeMo Automodel's own ``GroupedExpertsLoRA`` (the real layer, imported from the installed
``nemo_automodel``) trained expert-parallel on 2 ranks: 4 experts, 2 per rank, LoRA on every
expert, gloo, CPU. Two warm-up steps with the same number of tokens on every rank, then a step
where the ranks hold $RAGGED_TOKENS tokens (default ``68,401``: the report's counts).

nemo-automodel 0.5.0 gathers the tokens with ``DTensor.from_local(x, ...).full_tensor()``
(``lora_experts.py:184``), which assumes every rank holds as many rows as this one: the ragged
step posts all-gathers of different sizes. A release with PR #3631 (0.7.0) exchanges the
lengths first and pads (``_gather_ep_inputs``): the same job runs to the end.

Only the modules the layer needs are imported (``_peft.lora_experts``, ``moe.config``,
``moe.experts``: torch only). The experts are sharded over the ep mesh the way Automodel's
``ExpertParallel._partition_fn`` does it (``distribute_tensor(param, ep_mesh, [Shard(0)])``
for every parameter, dim 0 being the expert dim), written out here because
``moe.parallelizer`` imports ``moe.layers`` -> ``models.common``, which needs transformers 5.
No ``backend`` is passed, so ``use_torch_mm`` is False: the per-expert loop (``_forward_loop``)
runs, which needs neither grouped_gemm nor ``torch._grouped_mm`` (CUDA only).
"""

import os

import torch
from _corpus import finish, init, mark
from nemo_automodel.components._peft.lora_experts import GroupedExpertsLoRA
from nemo_automodel.components.moe.config import MoEConfig
from nemo_automodel.components.moe.experts import GroupedExperts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

rank, world = init()
ragged = [int(t) for t in os.environ.get("RAGGED_TOKENS", "68,401").split(",")]
ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))

DIM, TOPK = 64, 2
config = MoEConfig(
    n_routed_experts=4, n_shared_experts=0, n_activated_experts=TOPK, n_expert_groups=1,
    n_limited_groups=1, train_gate=False, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
    score_func="softmax", route_scale=1.0, dim=DIM, inter_dim=128, moe_inter_dim=32,
    norm_topk_prob=True, dtype=torch.float32)

torch.manual_seed(0)
base = GroupedExperts(config)
with torch.no_grad():
    base.gate_and_up_projs.normal_(0.0, 0.02)
    base.down_projs.normal_(0.0, 0.02)
experts = GroupedExpertsLoRA(base, lora_dim=8, alpha=16)
for name, param in list(experts.named_parameters(recurse=False)):
    sharded = torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))
    sharded.requires_grad = param.requires_grad
    experts.register_parameter(name, sharded)

router = torch.nn.Linear(DIM, config.n_routed_experts, bias=False)
opt = torch.optim.SGD([p for p in experts.parameters() if p.requires_grad], lr=0.1)
torch.manual_seed(1 + rank)

for step in range(4):
    n_tokens = 64 if step < 2 else ragged[rank]
    x = torch.randn(n_tokens, DIM)
    scores = router(x).softmax(dim=-1)
    weights, indices = scores.topk(TOPK, dim=-1)
    token_mask = torch.ones(n_tokens, dtype=torch.bool)
    if step == 2:
        mark("hang")
    y = experts(x, token_mask, weights, indices)  # corpus: experts
    loss = y.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"rank {rank} step {step}: {n_tokens} tokens, loss {loss.item():.6f}", flush=True)
finish()
