"""A DDP script that forgets torch.cuda.set_device(LOCAL_RANK): every rank puts its model on
cuda:0, the classic slip when moving from one GPU to several. NCCL refuses two ranks on one GPU
("Duplicate GPU detected") at the first collective. Needs CUDA and NCCL; on one GPU it fails the
same way as on eight.

torchrun --nproc-per-node 2 nccl_same_gpu.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("nccl")
    device = torch.device("cuda")  # the slip: cuda:0 on every rank
    model = DDP(nn.Linear(16, 16).to(device))  # WRAP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(8, 16, device=device)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
