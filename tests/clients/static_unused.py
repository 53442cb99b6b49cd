"""DDP with static_graph=True and find_unused_parameters=True on a model whose auxiliary head is
not used by the training forward (only the evaluation every EVAL_EVERY steps, under no_grad, runs
it): static_graph requires the same set of used parameters on every training step.

torchrun --nproc-per-node 2 static_unused.py
Environment: STEPS (40), BATCH (16), EVAL_EVERY (10).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.head = nn.Linear(32, 5)
        self.aux = nn.Linear(32, 1)

    def forward(self, x, with_aux):
        h = self.trunk(x)
        out = self.head(h)
        return (out, self.aux(h)) if with_aux else (out, None)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    eval_every = int(os.environ.get("EVAL_EVERY", "10"))
    model = DDP(MultiTask(), static_graph=True, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    for step in range(1, steps + 1):
        x, y = torch.randn(batch, 10), torch.randn(batch, 5)
        out, _ = model(x, with_aux=False)  # FORWARD
        loss = nn.functional.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
        if step % eval_every == 0:
            model.eval()
            with torch.no_grad():
                out, aux = model(torch.randn(batch, 10), with_aux=True)
                score = torch.stack([out.pow(2).mean(), aux.pow(2).mean()])
            dist.all_reduce(score)  # EVAL
            model.train()
            if rank == 0:
                print(f"step {step} eval {score.tolist()}", flush=True)
    checksum = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
    print(f"rank {rank} steps {step} checksum {checksum.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
