"""A 2×2 device mesh (4 ranks): dims ("ep", "tp"). The LoRA weights of the experts are to be
gathered over the expert-parallel group; ranks $WRONG_GROUP_RANKS (default 2,3) pick the
tensor-parallel group instead (a wrong mesh-dim name in their branch of the code). Their
gather completes among themselves and they go on to the loss all-reduce, while ranks 0 and 1
wait for them in the expert-group gather."""

import torch
import torch.distributed as dist
from _corpus import finish, init, mark, roles
from torch.distributed.device_mesh import init_device_mesh

rank, world = init()
wrong = roles("WRONG_GROUP_RANKS", "2,3")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
ep, tp = mesh.get_group("ep"), mesh.get_group("tp")


def gather_lora(a: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty(dist.get_world_size(group) * a.shape[0], a.shape[1])
    dist.all_gather_into_tensor(out, a, group=group)  # corpus: gather
    return out


lora_a = torch.randn(4, 8)
for step in range(4):
    group = tp if (rank in wrong and step == 2) else ep
    if step == 2:
        mark("hang")
    full = gather_lora(lora_a, group)
    loss = full.sum().reshape(1)
    dist.all_reduce(loss)  # corpus: loss
finish()
