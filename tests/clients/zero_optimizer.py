"""DDP with torch.distributed.optim.ZeroRedundancyOptimizer: each rank keeps the Adam state of its
shard of the parameters and, after its step, broadcasts its shard to the others.

torchrun --nproc-per-node 2 zero_optimizer.py
Environment: STEPS (40), BATCH (16).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    torch.manual_seed(rank)
    done = 0
    for _ in range(steps):
        x, y = torch.randn(batch, 10), torch.randn(batch, 5)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()  # OPTIMIZER
        done += 1
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        state = optimizer.state_dict()
        print(f"consolidated state of {len(state['state'])} parameters", flush=True)
    checksum = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
    print(f"rank {rank} steps {done} checksum {checksum.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
