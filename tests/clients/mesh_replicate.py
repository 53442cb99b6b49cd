"""Data parallel over a DeviceMesh, as the composable-API docs write it, launched by torchrun.

torchrun --nproc-per-node 2 mesh_replicate.py, or python mesh_replicate.py, which starts its two
ranks itself with mp.spawn (RANK and WORLD_SIZE set in each worker, init_device_mesh then starts
the process group). Environment: MASTER_PORT (required with python), STEPS (40), BATCH (16), MODE:
- "replicate" (default): init_device_mesh("cpu", (world,)), then
  torch.distributed._composable.replicate(model, device_mesh=mesh), an ordinary loop;
- "dtensor": the parameters distributed with distribute_tensor as Replicate on the mesh, each
  rank's batch a Shard(0) DTensor: DTensor's backward all-reduces the gradients itself;
- "subgroups": dist.new_subgroups(group_size=world), DDP on the subgroup, and an all_reduce of the
  loss on the world every 4 steps.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP


def model_for(mode, mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5))
    if mode == "replicate":
        return replicate(model, device_mesh=mesh)
    if mode == "dtensor":
        for module in model:
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(
                    name, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]))
                )
        return model
    subgroup, _ = dist.new_subgroups(group_size=dist.get_world_size())
    return DDP(model, process_group=subgroup)


def batch_for(mode, mesh, batch):
    inputs, targets = torch.randn(batch, 10), torch.randn(batch, 5)
    if mode == "dtensor":
        return DTensor.from_local(inputs, mesh, [Shard(0)]), DTensor.from_local(targets, mesh, [Shard(0)])
    return inputs, targets


def main():
    mode = os.environ.get("MODE", "replicate")
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    model = model_for(mode, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        inputs, targets = batch_for(mode, mesh, batch)
        loss = nn.functional.mse_loss(model(inputs), targets)  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
        if mode == "subgroups" and step % 4 == 0:
            dist.all_reduce(loss.detach())  # LOSS_ALL_REDUCE
    weights = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    print(
        f"rank {dist.get_rank()} steps {steps} checksum {sum(float(w.sum()) for w in weights):.6f}",
        flush=True,
    )
    dist.destroy_process_group()


def spawned(rank, world_size):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1"
    )
    main()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        mp.spawn(spawned, args=(2,), nprocs=2)
