"""Hand-written data parallelism over a small MoE: each parameter's gradient all-reduced
async and waited after the loop, skipped where the gradient is None. At step 3 rank
$CULPRIT_RANK (default 1) routes no token to expert 2, whose weight and bias then have no
gradient: it skips their two all-reduces, and the next expert's (the same sizes) pair
silently with them until its loss all-reduce (1 element) meets the other's last expert
weight (16x16) and gloo aborts both. Written for the occasion (issue 27's new-user trial)."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
starved = role("CULPRIT_RANK", 1)
E, D = 4, 16
router = torch.nn.Linear(D, E)
experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(E))
params = list(router.parameters()) + list(experts.parameters())
opt = torch.optim.SGD(params, lr=0.01)

for step in range(6):
    if step == 3:
        mark("hang")
    x_TD = torch.randn(32, D)
    choice_T = router(x_TD).argmax(-1)
    if step == 3 and rank == starved:  # this rank's data sends no token to expert 2
        choice_T = torch.where(choice_T == 2, torch.zeros_like(choice_T), choice_T)
    y_TD = torch.zeros_like(x_TD)
    for e in range(E):
        idx_N = (choice_T == e).nonzero().squeeze(-1)
        if idx_N.numel():
            y_TD[idx_N] = experts[e](x_TD[idx_N]) * router(x_TD[idx_N]).softmax(-1)[:, e:e + 1]
    loss = y_TD.pow(2).mean()
    loss.backward()
    works = []
    for p in params:  # corpus: params_loop
        if p.grad is not None:  # corpus: grad_gate
            works.append(dist.all_reduce(p.grad, async_op=True))  # corpus: grad_allreduce
    for w in works:
        w.wait()
    opt.step()
    opt.zero_grad(set_to_none=True)
    logged = torch.tensor([loss.item()])
    dist.all_reduce(logged)  # corpus: loss
finish()
