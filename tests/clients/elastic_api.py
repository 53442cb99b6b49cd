"""A script that starts its own workers through torch's programmatic elastic API (what torchrun
runs inside), with the c10d rendezvous: `elastic_launch(LaunchConfig(...), train)(args)`.

python elastic_api.py
Environment: MASTER_PORT (the rendezvous port, 29500), STEPS (40), BATCH (16), START_METHOD (spawn).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel as DDP


def train(steps, batch):
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the agent
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(torch.randn(batch, 10)), torch.randn(batch, 5))  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
    total = sum(p.detach().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    return total


def main():
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{os.environ.get('MASTER_PORT', '29500')}",
        run_id=f"elastic-api-{os.getpid()}",
        max_restarts=0,
        monitor_interval=0.5,
        start_method=os.environ.get("START_METHOD", "spawn"),
    )
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    results = elastic_launch(config, train)(steps, batch)  # LAUNCH
    print(f"checksums {sorted(round(v, 4) for v in results.values())}", flush=True)


if __name__ == "__main__":
    main()
