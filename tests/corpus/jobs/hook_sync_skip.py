"""Adaptive depth with a hand-written overlapped gradient sync: every parameter's gradient is
all-reduced asynchronously from a post-accumulate-grad hook as backward produces it, and the
step waits on all of them before the optimizer. Block 2 runs only where a sample of the
rank's own batch needs it; at step 3 rank $CULPRIT_RANK's (default 1) batch is easy, the
block is skipped, its two parameters get no gradient and their hooks never post. The
others' last two all-reduces pair silently with its next ones (equal sizes, 32 and 1024
floats), and at the end it waits in the final barrier while they wait in their last two.
Written for the occasion (issue 27's new-user trial): the fix said only "ran different
numbers of iterations, or cut one short"."""

import torch
import torch.distributed as dist
import torch.nn as nn
from _corpus import finish, init, mark, role

rank, world = init()
easy = role("CULPRIT_RANK", 1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            hard_B = x_BD.norm(dim=-1) > 2.0
            if i == 2 and not hard_B.any():
                continue  # no sample needs the deep block
            x_BD = x_BD + torch.relu(block(x_BD))
        return x_BD


net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
pending: list[dist.Work] = []


def sync(p: torch.Tensor) -> None:
    pending.append(dist.all_reduce(p.grad, async_op=True))  # corpus: hook_allreduce


for p in net.parameters():
    p.register_post_accumulate_grad_hook(sync)

for step in range(6):
    if step == 3:
        mark("hang")
    g = torch.Generator().manual_seed(100 * step + rank)
    x_BD = torch.randn(16, 32, generator=g)
    if step == 3 and rank == easy:
        x_BD = x_BD * 0.01  # an easy batch: every sample small
    loss = net(x_BD).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for w in pending:
        w.wait()  # corpus: wait
    pending.clear()
    opt.step()
dist.barrier()  # corpus: barrier
finish()
