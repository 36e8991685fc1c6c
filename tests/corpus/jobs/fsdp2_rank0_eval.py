"""FSDP2 (``fully_shard`` per block, no experts): a plain MLP of three equal blocks and a head,
trained on every rank. Between steps 1 and 2 only rank $CULPRIT_RANK (default 0) evaluates
(``if rank == 0: evaluate(model)``), and an evaluation forward of an FSDP model all-gathers
every block's parameters: those all-gathers pair silently with the other rank's step-2
training all-gathers (the same blocks, the same sizes), and the ranks drift apart until the
collectives no longer match (in the other rank's backward)."""

import torch
from _corpus import finish, init, mark, role
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

rank, world = init()
evaluator = role("CULPRIT_RANK", 0)
mesh = init_device_mesh("cpu", (world,))


class MLP(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))  # corpus: block
        return self.head(x)


def evaluate(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        x = torch.randn(16, 32)
        accuracy = (model(x).argmax(-1) == 0).float().mean()  # corpus: eval_forward
    model.train()
    return float(accuracy)


torch.manual_seed(0)
model = MLP()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model.head, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)

for step in range(4):
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    if step == 2:
        mark("hang")
    loss = torch.nn.functional.cross_entropy(model(x), y)  # corpus: forward
    loss.backward()  # corpus: backward
    opt.step()
    opt.zero_grad()
    if step == 1 and rank == evaluator:
        print(f"eval accuracy {evaluate(model):.3f}", flush=True)
finish()
