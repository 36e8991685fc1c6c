"""Evaluation only on one rank: ``if rank == 0: evaluate()`` (the rank is $CULPRIT_RANK, default
0), but ``evaluate`` averages its metrics with an all-reduce. That rank posts the metrics
all-reduce (2 elements) while the other ranks have gone on to the next step's gradient
all-reduce (32 elements). Three ranks: the odd one out is the evaluating rank."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
evaluator = role("CULPRIT_RANK", 0)


def evaluate() -> float:
    metrics = torch.tensor([1.0, 4.0])  # (correct, seen)
    dist.all_reduce(metrics)  # corpus: eval_allreduce
    return float(metrics[0] / metrics[1])


for step in range(4):
    grad = torch.randn(32)
    if step == 2:
        mark("hang")
    dist.all_reduce(grad)  # corpus: allreduce
    if step == 1 and rank == evaluator:
        print(f"eval accuracy {evaluate():.3f}", flush=True)
finish()
