"""A Lightning Fabric training loop on CPU with strategy="ddp", launched by torchrun.

torchrun --nproc-per-node 2 fabric_script.py
Fabric wraps the model in DDP in `fabric.setup`, gives each rank its share of the data through
`setup_dataloaders` (a DistributedSampler), and reduces the loss for logging every LOG_EVERY steps.
Environment: STEPS (40), BATCH (8), LOG_EVERY (4).
"""

import os

import lightning.fabric as lf
import torch
import torch.nn as nn


def main():
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "8"))
    log_every = int(os.environ.get("LOG_EVERY", "4"))
    fabric = lf.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    n = steps * batch * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 10), torch.randn(n, 5))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=batch))
    model.train()
    for step, (inputs, targets) in enumerate(loader, start=1):
        optimizer.zero_grad()
        outputs = model(inputs)  # FORWARD
        loss = nn.functional.mse_loss(outputs, targets)
        fabric.backward(loss)  # BACKWARD
        optimizer.step()
        if step % log_every == 0:
            mean = fabric.all_reduce(loss.detach(), reduce_op="mean")  # LOG
            fabric.print(f"step {step} loss {mean.item():.4f}")
        if step == steps:
            break
    fabric.barrier()  # BARRIER
    fabric.print("done")
    print(f"rank {fabric.global_rank} steps {step}", flush=True)


if __name__ == "__main__":
    main()
