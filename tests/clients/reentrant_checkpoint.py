"""A DDP model whose blocks run under torch.utils.checkpoint with use_reentrant=True (the old
default that many scripts still pass), which DDP supports with static_graph=True.

torchrun --nproc-per-node 2 reentrant_checkpoint.py
Environment: STEPS (12), BATCH (8), STATIC (1: static_graph=True).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Net(), static_graph=os.environ.get("STATIC", "1") == "1")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = int(os.environ.get("BATCH", "8"))
    for _step in range(1, int(os.environ.get("STEPS", "12")) + 1):
        x = torch.randn(batch, 16, requires_grad=True)
        loss = model(x).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
