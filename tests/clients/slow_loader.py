"""A DDP loop whose rank 1 reads its samples slowly, in its DataLoader workers (a slow disk on its
node): rank 1 is the straggler, and its time goes where its workers spend theirs.

torchrun --nproc-per-node 2 slow_loader.py
Environment: STEPS (200), WORKERS (2), SLOW (0.04 s per sample on rank 1), BATCH (8).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Samples(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        if int(os.environ.get("RANK", "0")) == 1:
            time.sleep(float(os.environ.get("SLOW", "0.04")))  # SLOW_READ
        return torch.randn(10), torch.randn(5)


def main():
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Samples()
    loader = DataLoader(
        data,
        batch_size=int(os.environ.get("BATCH", "8")),
        sampler=DistributedSampler(data),
        num_workers=int(os.environ.get("WORKERS", "2")),
    )
    steps = int(os.environ.get("STEPS", "200"))
    for step, (x, y) in enumerate(loader, start=1):  # LOADER
        loss = (model(x) - y).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
        if step == steps:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
