"""A 2-stage pipeline written by hand: at step 1 both stages post their recv before their send
(stage 0 waits for stage 1's gradient, stage 1 for stage 0's activation): each waits for the
other for ever, a wait-for cycle."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark

rank, world = init()
peer = 1 - rank
act, grad = torch.randn(4, 8), torch.empty(4, 8)
for step in range(3):
    if step == 0:  # the right order: stage 0 sends first, stage 1 receives first
        if rank == 0:
            dist.send(act, peer)
            dist.recv(grad, peer)
        else:
            dist.recv(grad, peer)
            dist.send(act, peer)
        continue
    mark("hang")
    dist.recv(grad, peer)  # corpus: recv
    dist.send(act, peer)
finish()
