"""A rank reads each record's name through ctypes from a C string a native loader handed it. At
step 2 the loader on rank $CULPRIT_RANK (default 1) returns a NULL pointer, and
``ctypes.string_at(0)`` dies with SIGSEGV inside the C call (strlen of NULL); the other rank
waits in that step's all-reduce."""

import ctypes

import torch
import torch.distributed as dist
from _corpus import init, mark, role

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
buf = ctypes.create_string_buffer(b"shard-00017/record")


def record_name(ptr: int) -> bytes:
    return ctypes.string_at(ptr)  # corpus: segv


for step in range(4):
    ptr = 0 if (rank == culprit and step == 2) else ctypes.addressof(buf)
    if step == 2:
        mark("hang")
    name = record_name(ptr)
    dist.all_reduce(torch.tensor([float(len(name))]))  # corpus: allreduce
dist.barrier()
dist.destroy_process_group()
