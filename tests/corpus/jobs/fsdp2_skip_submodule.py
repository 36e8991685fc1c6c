"""FSDP2 (``fully_shard``, parameters as DTensors): a model of three submodules, each its own
FSDP unit, plus the root. At step 2 rank $CULPRIT_RANK (default 1) skips the ``refine`` block
(a "short batch" fast path), so it never posts refine's parameter all-gather: its next
all-gather (the head's) meets the others' refine all-gather."""

import torch
from _corpus import finish, init, mark, role
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
mesh = init_device_mesh("cpu", (world,))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.refine = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, fast_path: bool = False) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if not fast_path:
            h = h + torch.relu(self.refine(h))  # corpus: refine
        return self.head(h)  # corpus: head


torch.manual_seed(0)
model = Net()
for block in (model.embed, model.refine, model.head):
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(4, 8)
    if step == 2:
        mark("hang")
    out = model(x, fast_path=(rank == culprit and step == 2))  # corpus: forward
    loss = out.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
finish()
