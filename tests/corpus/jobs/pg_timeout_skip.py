"""A 5 s process-group timeout. Three ranks; at step 2 rank $CULPRIT_RANK (default 2) skips the
dense-gradient all-reduce on the default group (its loss was NaN and it "skipped the update")
and goes on to the expert all-gather on another group. The other ranks wait in the all-reduce,
the culprit in the all-gather; after 5 s gloo times them out and they raise. The ranks that
timed out are victims; the culprit is the rank that skipped."""

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init(timeout_s=5.0)
skipper = role("CULPRIT_RANK", 2)
expert_group = dist.new_group(list(range(world)))
for step in range(4):
    grad = torch.ones(16)
    loss_is_nan = rank == skipper and step == 2
    if step == 2:
        mark("hang")
    if not loss_is_nan:
        dist.all_reduce(grad)  # corpus: allreduce
    out = torch.empty(world * 4)
    dist.all_gather_into_tensor(out, torch.ones(4), group=expert_group)  # corpus: allgather
dist.barrier()
dist.destroy_process_group()
