"""Async all-reduces waited later, as NCCL jobs post them; at step 4 rank $CULPRIT_RANK
(default 1) skips its embedding's gradient sync (its data hit no row of it) and goes on —
the embedding and head are one size, so the next all-reduce pairs silently. It finishes its
steps and evaluates (no collective, module level); the other waits in ``work.wait()``
inside the loop for ever. Written for the occasion (issue 27's new-user trial)."""

import time

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
skipper = role("CULPRIT_RANK", 1)
emb_VD = torch.ones(64, 8)
head_VD = torch.ones(64, 8)  # tied sizes: equal messages pair silently
for step in range(6):
    works = []
    if not (step == 4 and rank == skipper):
        works.append(dist.all_reduce(emb_VD, async_op=True))
    works.append(dist.all_reduce(head_VD, async_op=True))
    for w in works:
        w.wait()  # corpus: wait
mark("hang")
time.sleep(300)  # corpus: eval
