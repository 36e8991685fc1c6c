"""A 2x2 mesh: expert parallel across pairs (ep), data parallel across them (dp). Each step's
tokens go through an all-to-all on the ep group; at step 3 rank $CULPRIT_RANK (default 3)
keeps no token and its layer returns before the exchange (a "fast path"). Its ep partner
waits in the all-to-all; it goes on through the dp all-reduce to the world one: a cycle.
Written for the occasion (issue 27's new-user trial, 4 ranks)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
ep = ep_groups[rank // 2]
dp = dp_groups[rank % 2]
empty = role("CULPRIT_RANK", 3)
w_D = torch.nn.Parameter(torch.randn(16))


def moe_layer(x_TD: torch.Tensor) -> torch.Tensor:
    if x_TD.shape[0] == 0:  # corpus: fast_path
        return x_TD  # nothing routed here: skip the exchange
    out_TD = torch.empty_like(x_TD)
    dist.all_to_all_single(out_TD, x_TD, group=ep)  # corpus: a2a
    return out_TD * w_D


for step in range(6):
    if step == 3:
        mark("hang")
    n = 0 if (rank == empty and step == 3) else 8
    x_TD = torch.randn(n, 16)
    y_TD = moe_layer(x_TD)
    loss = y_TD.sum() * 0 + w_D.sum()
    loss.backward()
    assert w_D.grad is not None
    dist.all_reduce(w_D.grad, group=dp)  # corpus: dp
    w_D.grad = None
    stats = torch.tensor([float(n)])
    dist.all_reduce(stats)  # corpus: stats
finish()
