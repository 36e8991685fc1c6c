"""A metrics thread all-reduces a counter on a group of its own every step, fed by a queue;
the main thread trains. At step 3 the metrics thread of the rank named by CULPRIT_RANK has
nothing to report and skips its all-reduce; the other rank's metrics thread then waits in its
last one for ever, while both main threads finish the loop and join their threads."""

import queue
import threading

import torch
import torch.distributed as dist
from _corpus import init, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
metrics = dist.new_group(backend="gloo")
steps: "queue.Queue[int | None]" = queue.Queue()


def report() -> None:
    while (step := steps.get()) is not None:
        if rank == culprit and step == 3:
            continue  # an empty counter this step: nothing reported
        count = torch.tensor([float(step)])
        dist.all_reduce(count, group=metrics)  # corpus: metric


thread = threading.Thread(target=report, name="metrics")
thread.start()
w = torch.ones(64)
for step in range(6):
    g = w * 0.5
    dist.all_reduce(g)
    steps.put(step)
steps.put(None)
thread.join()  # corpus: join
dist.barrier()  # corpus: barrier
dist.destroy_process_group()
