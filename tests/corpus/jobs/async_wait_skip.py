"""NCCL's way of waiting, on gloo: every step posts its gradient all-reduce with
``async_op=True``, computes, and waits on the handle at the end of the step. At step 2 rank
$CULPRIT_RANK (default 1) does not post it (`if not (rank == culprit and step == 2)`); its
later posts pair one step early, and it reaches the final barrier while the other rank waits
on its last handle in ``work.wait()`` — a line that is no collective call."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
g = torch.ones(1024)
h = torch.randn(64, 64)
for step in range(6):
    if step == 2:
        mark("hang")
    if not (rank == culprit and step == 2):
        work = dist.all_reduce(g, async_op=True)  # corpus: post
    for _ in range(20):
        h = torch.tanh(h @ h)  # overlap compute with the reduction
    work.wait()  # corpus: wait
dist.barrier()  # corpus: barrier
dist.destroy_process_group()
