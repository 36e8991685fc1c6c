"""The NeMo GroupedExpertsLoRA gather: DTensor.from_local(Shard(0)).full_tensor() on ragged rows."""

import torch
import torch.distributed as dist
from _common import init, mark, warmup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

rank, world = init()
warmup()
mesh = init_device_mesh("cpu", (world,))


def gather_tokens(x):
    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).full_tensor()


x = torch.randn([68, 401, 1607, 230][rank], 64)
mark("hang")
y = gather_tokens(x)
print(rank, y.shape, flush=True)
dist.barrier()
dist.destroy_process_group()
