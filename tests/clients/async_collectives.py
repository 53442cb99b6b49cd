"""Collectives issued with async_op=True and waited later, overlapped with compute, as a
hand-written data-parallel loop does without DDP; plus all_gather_into_tensor and
all_to_all_single of an expert-parallel style exchange.

torchrun --nproc-per-node 2 async_collectives.py
Environment: STEPS (12), BATCH (8).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # BROADCAST
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = int(os.environ.get("BATCH", "8"))
    for _step in range(1, int(os.environ.get("STEPS", "12")) + 1):
        x = torch.randn(batch, 8)
        tokens = torch.arange(world * 2, dtype=torch.float32) + rank
        routed = torch.empty_like(tokens)
        dist.all_to_all_single(routed, tokens)  # ALL_TO_ALL
        loss = model(x).pow(2).mean() + routed.sum() * 0  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        handles = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]  # ASYNC
        stats = torch.empty(world * 2)
        dist.all_gather_into_tensor(stats, torch.tensor([loss.item(), float(batch)]))  # GATHER
        for handle in handles:
            handle.wait()  # WAIT
        for p in model.parameters():
            p.grad /= world
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
