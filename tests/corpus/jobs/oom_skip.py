"""Skip a batch that runs out of memory, as many training scripts do: ``try:`` forward and
backward, ``except RuntimeError: ... continue``. Rank $CULPRIT_RANK (default 1) packs a long
batch at step 3 and its allocator refuses the activations, so it skips that step's backward:
its buckets' all-reduces pair silently with the others' next step, and it ends in the final
barrier while they wait in the last backward. Written for the occasion (a new user's trial):
the fix named no way past — the source facts knew ``if ...: continue``, not a handler."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
big = role("CULPRIT_RANK", 1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        if x_BD.shape[0] > 64:  # a long batch: its activations do not fit
            torch.empty(10**13)  # the allocator refuses: RuntimeError, out of memory
        return self.body(x_BD)


def train() -> None:
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        if step == 3:
            mark("hang")
        n = 128 if (rank == big and step == 3) else 8  # this rank's packed batch is long
        g = torch.Generator().manual_seed(100 * step + rank)
        x_BD, y_B1 = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)
        try:
            loss = nn.functional.mse_loss(model(x_BD), y_B1)
            loss.backward()  # corpus: backward
        except RuntimeError as e:  # corpus: handler
            if "memory" not in str(e):
                raise
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    dist.barrier()  # corpus: barrier


train()
finish()
