"""Data parallel inside pairs of "pipeline" stages: 4 ranks as 2 stages x 2 replicas.

torchrun --nproc-per-node 4 dp_pp_groups.py
Ranks 0,1 hold stage 0 and ranks 2,3 stage 1 (data-parallel groups [0,1] and [2,3], each its own
DDP process group); rank r of stage 0 sends its activations to rank r+2 (pipeline groups [0,2] and
[1,3]), which broadcasts a scalar back on the pipeline group. Every step ends with a loss
all-reduce over the whole world. Environment: STEPS (12), BATCH (4).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this program runs on 4 ranks"
    stage = rank // 2
    # every rank creates every group, in the same order, as new_group requires
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, pp = dp_groups[stage], pp_groups[rank % 2]
    torch.manual_seed(stage)
    model = DDP(nn.Linear(8, 8), process_group=dp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = int(os.environ.get("BATCH", "4"))
    for _step in range(1, int(os.environ.get("STEPS", "12")) + 1):
        x = torch.randn(batch, 8)
        if stage == 1:
            dist.broadcast(x, src=rank - 2, group=pp)  # RECV ACTIVATIONS
        out = model(x)  # FORWARD
        loss = out.pow(2).mean()
        loss.backward()  # BACKWARD
        if stage == 0:
            dist.broadcast(out.detach(), src=rank, group=pp)  # SEND ACTIVATIONS
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # LOSS
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
