"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on CPU with gloo: each block and then the whole
model is sharded; parameters are all-gathered for the forward and gradients reduce-scattered in
the backward.

torchrun --nproc-per-node 2 fsdp2_script.py
Environment: STEPS (40), BATCH (16).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    done = 0
    for _ in range(steps):
        x, y = torch.randn(batch, 10), torch.randn(batch, 5)
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()  # OPTIMIZER
        optimizer.zero_grad()
        done += 1
    checksum = torch.stack([p.full_tensor().sum() for p in model.parameters()]).sum()
    print(f"rank {rank} steps {done} checksum {checksum.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
