"""A torchrun script with torch.distributed.elastic's @record on main, metrics gathered as Python
objects every few steps (all_gather_object, then broadcast_object_list of the decision rank 0
takes from them), and a monitored_barrier at the end so that a rank that never arrives is named.

torchrun --nproc-per-node 2 record_metrics.py
Environment: STEPS (40), BATCH (16), METRICS_EVERY (5), MONITOR_TIMEOUT (30: seconds the monitored_barrier
waits for a rank before it fails, naming it).
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    metrics_every = int(os.environ.get("METRICS_EVERY", "5"))
    monitor_timeout = float(os.environ.get("MONITOR_TIMEOUT", "30"))
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(rank)
    best = float("inf")
    for step in range(1, steps + 1):
        x, y = torch.randn(batch, 10), torch.randn(batch, 5)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
        if step % metrics_every == 0:
            gathered = [None] * world
            dist.all_gather_object(gathered, {"rank": rank, "loss": loss.item()})  # GATHER
            decision = [None]
            if rank == 0:
                mean = sum(m["loss"] for m in gathered) / world
                decision = [{"step": step, "mean": mean, "improved": mean < best}]
            dist.broadcast_object_list(decision, src=0)  # DECIDE
            best = min(best, decision[0]["mean"])
            if rank == 0:
                print(f"step {step} mean loss {decision[0]['mean']:.4f}", flush=True)
    dist.monitored_barrier(timeout=timedelta(seconds=monitor_timeout))  # MONITORED
    print(f"rank {rank} steps {step} best {best:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
