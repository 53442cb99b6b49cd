"""accelerate's notebook_launcher run from a script (as a notebook cell would call it): the
training function builds its Accelerator inside, on CPU; the launcher starts 2 processes through
torch's elastic agent (forked workers on CPU).

python accelerate_notebook.py
Environment: MASTER_PORT (the launcher's use_port, 29500), STEPS (40), BATCH (8).
"""

import os

import torch
import torch.nn as nn
from accelerate import Accelerator, notebook_launcher


def training_function(steps, batch):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * batch * 2, 10), torch.randn(steps * batch * 2, 5)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, (inputs, targets) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(model(inputs), targets)  # FORWARD
        accelerator.backward(loss)  # BACKWARD
        optimizer.step()
        optimizer.zero_grad()
        if step >= steps:
            break
    accelerator.print(f"final loss {loss.item():.4f}")
    accelerator.end_training()
    print(f"rank {accelerator.process_index} done", flush=True)


if __name__ == "__main__":
    args = (int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "8")))
    notebook_launcher(
        training_function, args, num_processes=2, use_port=os.environ.get("MASTER_PORT", "29500")
    )  # LAUNCH
