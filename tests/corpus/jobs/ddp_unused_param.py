"""torch DDP without find_unused_parameters: at step 2 rank $CULPRIT_RANK (default 1) takes a
shortcut in forward and skips the ``refine`` submodule, so its parameters get no gradient.
That rank's reducer never finishes the step; its next forward raises "Expected to have
finished reduction in the prior iteration ...", while the other ranks wait in backward's
bucket all-reduce."""

import torch
import torch.distributed as dist
from _corpus import init, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
culprit = role("CULPRIT_RANK", 1)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(16, 16)
        self.refine = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, shortcut: bool = False) -> torch.Tensor:
        h = torch.relu(self.encode(x))
        if not shortcut:
            h = h + torch.relu(self.refine(h))
        return self.head(h)


model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    out = model(x, shortcut=(rank == culprit and step == 2))  # corpus: forward
    loss = torch.nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()  # corpus: backward
    opt.step()
dist.barrier()
dist.destroy_process_group()
