"""A DDP script started with more ranks per node than the node has GPUs (`--nproc-per-node 2` on
a one-GPU machine): rank 1's `torch.cuda.set_device(LOCAL_RANK)` asks for a GPU that is not there
("invalid device ordinal"). Needs CUDA.

torchrun --nproc-per-node 2 more_ranks_than_gpus.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # SET_DEVICE
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(16, 16).cuda(), device_ids=[local_rank])
    loss = model(torch.randn(8, 16, device="cuda")).sum()
    loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
