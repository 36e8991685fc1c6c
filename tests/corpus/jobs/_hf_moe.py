"""A tiny transformers Mixtral (built from a config: nothing is downloaded) with peft LoRA on
every expert's w1/w2/w3 and FSDP2 ``fully_shard`` on every expert (LoRA inside its unit) and on
the model: the shape of a LoRA fine-tune of an MoE model with per-expert sharding.

transformers 4.57's ``MixtralSparseMoeBlock.forward`` loops only over the experts that got a
token (``expert_hit``), so an expert no token reaches on one rank is not called there: its
FSDP all-gather is never posted on that rank.

Routing is made deterministic with a forward hook on each router (``gate``) that adds a bias to
its logits: token t prefers experts t % E and (t + 1) % E, and on the rank, step and layer
chosen by ``starve`` one expert gets -1e4 (no token reaches it on that rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

N_EXPERTS = 4
N_LAYERS = 2
SEQ = 16
VOCAB = 64


class Routing:
    """Which expert is starved where: set ``step`` before each forward."""

    def __init__(self, starve: Callable[[int, int], int | None]):
        self.starve = starve  # (step, layer) -> expert or None
        self.step = 0

    def hook(self, layer: int) -> Callable[..., Any]:
        def bias_logits(module: torch.nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
            t = torch.arange(logits.shape[0])
            bias = torch.zeros_like(logits)
            bias[t, t % N_EXPERTS] += 20.0
            bias[t, (t + 1) % N_EXPERTS] += 10.0
            expert = self.starve(self.step, layer)
            if expert is not None:
                bias[:, expert] = -1e4
            return logits + bias

        return bias_logits


def build(world: int, routing: Routing) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=N_LAYERS, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=N_EXPERTS,
                        num_experts_per_tok=2, max_position_embeddings=64,
                        router_jitter_noise=0.0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for i, layer in enumerate(base.model.layers):
        layer.block_sparse_moe.gate.register_forward_hook(routing.hook(i))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["w1", "w2", "w3"]))
    mesh = init_device_mesh("cpu", (world,))
    for layer in base.model.layers:
        for expert in layer.block_sparse_moe.experts:
            fully_shard(expert, mesh=mesh)
    fully_shard(base, mesh=mesh)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, SEQ), generator=g)
