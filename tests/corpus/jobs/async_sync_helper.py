"""NCCL's way of waiting, on gloo, with two collectives in flight: every step posts two
all-reduces of equal size with ``async_op=True`` (two DDP-like gradient buckets), keeps their
handles in a list, computes, and ends the step in a ``synchronize(pending)`` helper that
waits on all of them — where ``torch.cuda.synchronize()`` would stand: the rank's stack shows
the helper's wait, no collective call and no line of either post. At step 2 rank
$CULPRIT_RANK (default 1) does not post the second bucket (`if not (rank == culprit and step
== 2)`): gloo pairs its next posts one collective early (equal sizes: silently), and it
reaches the final barrier while the other ranks wait on their last bucket in the helper."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role


def synchronize(pending: list) -> None:
    """Wait for everything in flight (a CUDA job: torch.cuda.synchronize())."""
    for work in pending:
        work.wait()  # corpus: wait
    pending.clear()


rank, world = init()
culprit = role("CULPRIT_RANK", 1)
bucket_a, bucket_b = torch.ones(512), torch.ones(512)
h = torch.randn(64, 64)
pending: list = []
for step in range(6):
    if step == 2:
        mark("hang")
    pending.append(dist.all_reduce(bucket_a, async_op=True))  # corpus: post_a
    if not (rank == culprit and step == 2):
        pending.append(dist.all_reduce(bucket_b, async_op=True))  # corpus: post_b
    for _ in range(20):
        h = torch.tanh(h @ h)  # overlap compute with the reductions
    synchronize(pending)
dist.barrier()  # corpus: barrier
dist.destroy_process_group()
