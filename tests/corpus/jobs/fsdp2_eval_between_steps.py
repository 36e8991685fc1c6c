"""FSDP2 training; after step 2 the rank named by CULPRIT_RANK alone runs an evaluation
forward (a user's "quick eval on one rank"). Its eval all-gathers pair silently with the
other rank's next training all-gathers (same sizes); gloo aborts one rank steps later."""

import torch
import torch.distributed as dist
from _corpus import init, role
from torch.distributed.fsdp import fully_shard

rank, world = init()
culprit = role("CULPRIT_RANK", 0)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.ff(x)) + x


model = torch.nn.Sequential(*[Block() for _ in range(4)], torch.nn.Linear(32, 1))
for blk in list(model)[:4]:
    fully_shard(blk)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def evaluate() -> float:
    with torch.no_grad():
        return model(torch.randn(4, 32)).mean().item()  # corpus: eval


for step in range(8):
    x, y = torch.randn(8, 32), torch.randn(8, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)  # corpus: forward
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 2 and rank == culprit:
        print("eval", evaluate(), flush=True)  # corpus: evaluate
dist.barrier()
dist.destroy_process_group()
