"""Data-parallel training fed by a prefetch thread: rank 0 reads each batch and broadcasts it
on a data group of their own; every rank's thread queues what it got. On rank $CULPRIT_RANK
(default 1) the thread raises a KeyError after its 7th broadcast (a sample missing from its
shard index) and ends: its main thread waits at ``q.get()`` and the others' threads wait in
the broadcast it will never post. Written for the occasion (issue 27's new-user trial)."""

import queue
import threading

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
data_pg = dist.new_group(backend="gloo")
short = role("CULPRIT_RANK", 1)
steps = 12
q: queue.Queue = queue.Queue(maxsize=2)


def prefetch() -> None:
    for i in range(steps):
        batch = torch.randn(8, 16) if rank == 0 else torch.empty(8, 16)
        dist.broadcast(batch, src=0, group=data_pg)  # corpus: broadcast
        if rank == short and i == 6:
            mark("hang")
            raise KeyError(f"sample {i * 8 + 3} missing from the shard index")  # corpus: raise
        q.put(batch)


threading.Thread(target=prefetch, daemon=True).start()
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(steps):
    x = q.get()  # corpus: get
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
finish()
