"""The expert-parallel token gather of NeMo's GroupedExpertsLoRA before its fix:
``DTensor.from_local(x, mesh, [Shard(0)]).full_tensor()`` on a ragged number of tokens per
rank (68 and 401): from_local assumes every rank holds as many rows as this one."""

import torch
from _corpus import finish, init, mark, warmup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

rank, world = init()
warmup()
mesh = init_device_mesh("cpu", (world,))


def gather_tokens(x: torch.Tensor) -> torch.Tensor:
    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).full_tensor()  # corpus: gather


x = torch.randn([68, 401, 1607, 230][rank], 64)
mark("hang")
y = gather_tokens(x)
print(rank, tuple(y.shape), flush=True)
finish()
