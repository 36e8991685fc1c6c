"""DDP with patience-based early stopping decided on the logging rank $CULPRIT_RANK (default
0): it alone breaks out of the epoch loop (`if rank == logger:` around the check) and waits
in the final barrier while the others go on into the next epoch's backward. Written for the
occasion (issue 27's new-user trial, 3 ranks)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
logger = role("CULPRIT_RANK", 0)
net = DDP(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(net.parameters(), lr=0.5)
best, bad_epochs = float("inf"), 0

for epoch in range(20):
    for it in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(epoch * 100 + it * 10 + rank))
        loss = net(x).sub(x).pow(2).mean()
        loss.backward()  # corpus: backward
        opt.step()
        opt.zero_grad()
    val = torch.tensor([loss.item()])
    dist.all_reduce(val)
    if rank == logger:  # corpus: logger_gate
        if val.item() / world > best - 1e-3:
            bad_epochs += 1
            if bad_epochs >= 2:
                mark("hang")
                break  # corpus: stop
        else:
            best, bad_epochs = val.item() / world, 0

dist.barrier()  # corpus: barrier
finish()
