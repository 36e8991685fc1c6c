"""A user's own job on NeMo Automodel's real ``GroupedExpertsLoRA`` (imported from the installed
``nemo_automodel``, whichever release is on the path): an MoE block the way Automodel's ``MoE``
composes one — a router (``gate``) and the experts (``experts``), LoRA on every expert —
trained expert-parallel on gloo ranks (4 experts, spread over the ranks), 64 tokens on every
rank every step. No fault is planted.

nemo-automodel 0.5.0 gathers the tokens with ``DTensor.from_local(x, ...).full_tensor()``,
which assumes every rank holds as many rows as this one; 0.7.0 (PR #3631) exchanges the
lengths first and pads. With equal batches both run to the end; moe-hang check's ragged plans
tell them apart. Only the modules the layer needs are imported (see
tests/corpus/jobs/automodel_lora_experts.py for why, and how the experts are sharded).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from nemo_automodel.components._peft.lora_experts import GroupedExpertsLoRA
from nemo_automodel.components.moe.config import MoEConfig
from nemo_automodel.components.moe.experts import GroupedExperts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

DIM, TOPK, EXPERTS, TOKENS = 64, 2, 4, 64


class MoEBlock(torch.nn.Module):
    """Router + experts, as Automodel's MoE block calls them."""

    def __init__(self, config: MoEConfig, ep_mesh) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)
        base = GroupedExperts(config)
        with torch.no_grad():
            base.gate_and_up_projs.normal_(0.0, 0.02)
            base.down_projs.normal_(0.0, 0.02)
        self.experts = GroupedExpertsLoRA(base, lora_dim=8, alpha=16)
        if ep_mesh is None:  # every expert local: the single-process reference
            return
        for name, param in list(self.experts.named_parameters(recurse=False)):
            sharded = torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))
            sharded.requires_grad = param.requires_grad
            self.experts.register_parameter(name, sharded)

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        weights_tk, indices_tk = self.gate(x_td).softmax(dim=-1).topk(TOPK, dim=-1)
        token_mask_t = torch.ones(x_td.shape[0], dtype=torch.bool)
        return x_td + self.experts(x_td, token_mask_t, weights_tk, indices_tk)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    config = MoEConfig(
        n_routed_experts=EXPERTS, n_shared_experts=0, n_activated_experts=TOPK,
        n_expert_groups=1, n_limited_groups=1, train_gate=False, gate_bias_update_factor=0.0,
        aux_loss_coeff=0.0, score_func="softmax", route_scale=1.0, dim=DIM, inter_dim=128,
        moe_inter_dim=32, norm_topk_prob=True, dtype=torch.float32)
    torch.manual_seed(0)
    model = MoEBlock(config, ep_mesh)
    opt = torch.optim.SGD([p for p in model.experts.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1 + rank)
    for step in range(args.steps):
        x_td = torch.randn(TOKENS, DIM)
        loss = model(x_td).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step}: loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
