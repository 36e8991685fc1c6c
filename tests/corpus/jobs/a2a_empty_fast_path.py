"""Expert-parallel dispatch the Megatron/torchtitan way, with a fast path: a rank with no
token returns before the token-count all_to_all_single. At step 3 the data filter leaves rank
$CULPRIT_RANK (default 1) no token: it skips both all-to-alls and waits in the same step's
gradient all-reduce while the other waits in the count exchange. Written for the occasion
(a new-user trial, issue 27)."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
from _corpus import finish, init, mark, role

rank, world = init()
empty = role("CULPRIT_RANK", 1)
D, PER_RANK = 8, 2


def dispatch(x_TD, expert_T):
    if x_TD.shape[0] == 0:  # corpus: fast_path
        return x_TD
    send_R = torch.bincount(expert_T, minlength=world * PER_RANK).view(world, PER_RANK).sum(1)
    recv_R = torch.empty_like(send_R)
    dist.all_to_all_single(recv_R, send_R)  # corpus: counts
    y_TD = torch.empty(int(recv_R.sum()), D)
    return dnn.all_to_all_single(y_TD, x_TD[expert_T.argsort()], recv_R.tolist(),
                                 send_R.tolist())


g = torch.Generator().manual_seed(rank)
w = torch.nn.Linear(D, D)
for step in range(6):
    if step == 3:
        mark("hang")
    x_TD = torch.randn(16, D, generator=g)
    if step == 3 and rank == empty:
        x_TD = x_TD[:0]  # the data filter dropped every sample of this rank's batch
    expert_T = torch.randint(0, world * PER_RANK, (x_TD.shape[0],), generator=g)
    y_TD = dispatch(w(x_TD), expert_T)
    (y_TD.square().mean() if y_TD.numel() else y_TD.sum() + 0 * w.weight.sum()).backward()
    for p in w.parameters():
        dist.all_reduce(p.grad)  # corpus: grads
        p.grad = None
finish()
