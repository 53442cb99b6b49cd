"""A DDP model under torch.compile with compiled autograd and DDP's Python reducer
(optimize_ddp="python_reducer"): DDP then calls comm hooks once per parameter with (grad, param).

torchrun --nproc-per-node 2 compiled_autograd.py
Environment: STEPS (6). Each rank trains on its own data and prints a checksum of its averaged
gradients: equal on every rank when the gradients were all-reduced.
"""

import os

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch._dynamo.config.optimize_ddp = "python_reducer"
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    data = torch.Generator().manual_seed(rank)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        for _ in range(int(os.environ.get("STEPS", "6"))):
            optimizer.zero_grad()
            loss = compiled(torch.randn(8, 10, generator=data)).pow(2).mean()  # FORWARD
            loss.backward()  # BACKWARD
            optimizer.step()
    checksum = sum(p.grad.double().sum().item() for p in model.parameters())
    print(f"rank {rank} gradient checksum {checksum:.9f}", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
