"""Each rank runs a background thread that keeps a core busy in native code, as a CUDA host
thread does when it spin-waits on a hung NCCL kernel; rank $RECEIVER (default 1) waits in recv
for a tensor rank $SENDER (default 0) never sends, while the sender waits in the all-reduce."""

import hashlib
import os
import threading

import torch
import torch.distributed as dist
from _common import init, mark, warmup


def spin() -> None:
    buf = bytes(8 << 20)
    while True:
        hashlib.sha256(buf).digest()  # releases the GIL: a core busy outside Python


rank, world = init(timeout_s=120)
warmup()
threading.Thread(target=spin, daemon=True).start()
sender, receiver = int(os.environ.get("SENDER", "0")), int(os.environ.get("RECEIVER", "1"))
mark("hang")
if rank == receiver:
    dist.recv(torch.empty(4), src=sender)  # never sent
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
