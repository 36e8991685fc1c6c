"""A user's own MoE model in plain torch: two MoE blocks (a ``gate`` linear, top-2 of 4
experts, ``experts`` a ModuleList), each expert its own FSDP2 unit, gloo on CPU, random tokens,
a few steps. No fault is planted. The blocks call only the experts that got a token — the
common way to write the loop, and the one that hangs when a rank routes an expert none:
``--fixed`` calls every expert every step (zero rows where it got none)."""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DIM, EXPERTS, TOPK, TOKENS = 16, 4, 2, 32


class MoEBlock(torch.nn.Module):
    def __init__(self, every_expert: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.top_k, self.every_expert = TOPK, every_expert

    def forward(self, x_td: torch.Tensor) -> torch.Tensor:
        w_tk, chosen_tk = self.gate(x_td).softmax(dim=-1).topk(self.top_k, dim=-1)
        out_td = torch.zeros_like(x_td)
        for e, expert in enumerate(self.experts):
            token_n, slot_n = torch.where(chosen_tk == e)
            if token_n.numel() == 0 and not self.every_expert:
                continue  # no token here: this rank never posts the expert's all-gather
            out_td = out_td.index_add(0, token_n, expert(x_td[token_n]) * w_tk[token_n, slot_n,
                                                                                 None])
        return x_td + out_td


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fixed", action="store_true")
    ap.add_argument("--compile", action="store_true")  # torch.compile over the sharded model
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoEBlock(args.fixed), MoEBlock(args.fixed))
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        for expert in block.experts:
            fully_shard(expert, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        loss = model(torch.randn(TOKENS, DIM, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
