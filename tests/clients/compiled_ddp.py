"""torch.compile around a DDP model, the form DDP's docs recommend: Dynamo's DDPOptimizer splits the
compiled graph at DDP's bucket boundaries (more than 1 MB of parameters: at least two buckets),
so each bucket's all-reduce can start while the backward of the graphs before it still runs.
The backend is aot_eager: the forward and backward graphs are traced as Inductor's would be,
without its C++ compile.

torchrun --nproc-per-node 2 compiled_ddp.py
Environment: STEPS (12), BATCH (8). Each rank prints the sum of its trained parameters.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 8))
    model = torch.compile(DDP(net), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    steps, batch = int(os.environ.get("STEPS", "12")), int(os.environ.get("BATCH", "8"))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(batch, 64, generator=data)).pow(2).mean()  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {rank} parameters {checksum!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
