"""A user's own job, written the way a LoRA fine-tune of an MoE model is: transformers'
Mixtral (a tiny config: nothing is downloaded), peft LoRA on every expert, FSDP2
``fully_shard`` per expert and on the model, gloo on CPU, a few steps of random tokens. No
fault is planted: whatever routing the model makes, it makes.

``--fixed`` applies the fix a user would write: every expert is called every step, on an empty
input where no token reached it (transformers 4.57's block calls only the experts that got a
token, so an expert that got none on one rank never posts its FSDP all-gather there).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, MixtralConfig
from transformers.models.mixtral import modeling_mixtral

VOCAB, SEQ = 64, 32


def every_expert_forward(self: modeling_mixtral.MixtralSparseMoeBlock,
                         hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's forward, every expert called (zero rows where it got no token)."""
    batch, seq, dim = hidden_states.shape
    flat_td = hidden_states.view(-1, dim)
    logits_te = self.gate(flat_td)
    weights_tk, chosen_tk = torch.topk(F.softmax(logits_te, dim=1, dtype=torch.float),
                                       self.top_k, dim=-1)
    weights_tk = (weights_tk / weights_tk.sum(dim=-1, keepdim=True)).to(flat_td.dtype)
    out_td = torch.zeros_like(flat_td)
    for e, expert in enumerate(self.experts):
        token_n, slot_n = torch.where(chosen_tk == e)
        y_nd = expert(flat_td[token_n]) * weights_tk[token_n, slot_n, None]
        out_td.index_add_(0, token_n, y_nd)
    return out_td.view(batch, seq, dim), logits_te


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fixed", action="store_true")
    args = ap.parse_args()
    if args.fixed:
        modeling_mixtral.MixtralSparseMoeBlock.forward = every_expert_forward
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, router_jitter_noise=0.0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["w1", "w2", "w3"]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in base.model.layers:
        for expert in layer.block_sparse_moe.experts:
            fully_shard(expert, mesh=mesh)
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
