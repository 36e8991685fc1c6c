"""Knowledge distillation on two ranks: every rank trains on its own batch; rank
$RECEIVER_RANK (default 1) also takes the teacher's logits from rank $CULPRIT_RANK (default 0),
under a rank condition. Nothing ever sends them (the send was never written): the receiver
waits in ``recv`` while the other rank goes on to the loss all-reduce."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
teacher = role("CULPRIT_RANK", 0)
student = role("RECEIVER_RANK", 1)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

for step in range(4):
    x = torch.randn(8, 16)
    logits = model(x)
    loss = logits.square().mean()
    if step == 2:
        mark("hang")
        if rank == student:
            teacher_logits = torch.empty(8, 4)
            dist.recv(teacher_logits, src=teacher)  # corpus: recv
            loss = loss + (logits - teacher_logits).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss.detach())  # corpus: allreduce
finish()
