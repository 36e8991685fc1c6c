"""After each epoch the best config is broadcast from the rank that found it
(``broadcast_object_list(cfg, src=best)``), ``best`` computed on each rank from its own copy
of the scores table; at epoch 2 rank $CULPRIT_RANK's copy (default 1) is stale and names
another rank. Every rank waits in the broadcast; the recorders match (they keep no root).
Written for the occasion (a new user's trial): watch waited on "ranks in broadcast #8"."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
stale = role("CULPRIT_RANK", 1)
w = torch.zeros(16)
for epoch in range(4):
    if epoch == 2:
        mark("hang")
    g = torch.ones(16) * (rank + 1)
    dist.all_reduce(g)
    w -= 0.01 * g
    scores = torch.tensor([float((r * 7 + epoch) % 5) for r in range(world)])
    if rank == stale and epoch == 2:
        scores[(stale + 2) % world] += 10.0  # this rank's stale copy of the table
    best = int(scores.argmax())
    cfg = [{"epoch": epoch, "lr": 0.01 * (best + 1)}]
    dist.broadcast_object_list(cfg, src=best)  # corpus: broadcast
finish()
