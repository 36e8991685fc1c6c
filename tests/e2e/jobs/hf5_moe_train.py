"""A user's own job on transformers 5's Mixtral, whose experts are fused: one ``MixtralExperts``
module holds every expert's weights as 3-D parameters (``gate_up_proj [E, 2I, H]``), run by
``grouped_mm``; peft LoRA on those parameters (``target_parameters``), FSDP2 ``fully_shard``
on each layer's experts and on the model, gloo on CPU, a few steps of random tokens. No fault
is planted.

Run with transformers 5 on the path (make corpus-deps puts 5.25.0 in .venv/corpus). The
experts module is called every step whatever the routing, so no plan can make one rank skip
its all-gather: moe-hang check runs every plan clean and says the experts are fused.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, MixtralConfig

VOCAB, SEQ = 64, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, router_jitter_noise=0.0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in base.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh)
    fully_shard(base, mesh=mesh)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
