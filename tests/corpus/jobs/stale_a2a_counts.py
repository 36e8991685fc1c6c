"""Expert-parallel all-to-all dispatch: each step the ranks first exchange how many tokens they
send to each other (an all_to_all_single of counts), then the tokens themselves. At step 2 rank
$CULPRIT_RANK (default 1) takes a "the routing did not change" shortcut, skips the count
exchange and reuses last step's counts, so it is already in the token all-to-all while the
other ranks are still in the count exchange."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
D = 8
recv_counts = torch.zeros(world, dtype=torch.long)  # last step's, once there is one
for step in range(4):
    send_counts = torch.tensor([2 + ((rank + r + step) % 3) for r in range(world)])
    tokens = torch.randn(int(send_counts.sum()), D)
    if step == 2:
        mark("hang")
    reuse = rank == culprit and step == 2
    if not reuse:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)  # corpus: counts
    out = torch.empty(int(recv_counts.sum()), D)
    dist.all_to_all_single(out, tokens, output_split_sizes=recv_counts.tolist(),  # corpus: tokens
                           input_split_sizes=send_counts.tolist())
finish()
