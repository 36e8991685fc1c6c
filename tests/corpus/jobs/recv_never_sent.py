"""Point-to-point: every step rank $RECEIVER_RANK (default 0) receives a tensor from rank
$CULPRIT_RANK (default 1), then both all-reduce. At step 2 the sender has nothing to send (an
empty micro-batch) and skips the send: it goes on to the all-reduce while the receiver waits in
recv for a tensor that is never sent.

With SPIN_THREAD=1 each rank also runs a background thread that keeps a CPU core busy in
native code without the GIL, as a CUDA spin-wait does on a GPU node, while the main thread
is blocked."""

import hashlib
import os
import threading

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, role

rank, world = init()
sender = role("CULPRIT_RANK", 1)
receiver = role("RECEIVER_RANK", 0)


def spin() -> None:
    buf = bytes(8 << 20)
    while True:
        hashlib.sha256(buf).digest()  # releases the GIL: a core busy in native code


if os.environ.get("SPIN_THREAD") == "1":
    threading.Thread(target=spin, daemon=True, name="cuda-spin").start()

for step in range(4):
    x = torch.randn(4, 8)
    if step == 2:
        mark("hang")
    if rank == sender and step != 2:
        dist.send(x, receiver)
    elif rank == receiver:
        dist.recv(x, sender)  # corpus: recv
    dist.all_reduce(x)  # corpus: allreduce
finish()
