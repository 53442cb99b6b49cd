"""A training script written for accelerate (its README's loop), launched by `accelerate launch`.

ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 accelerate_script.py
Environment: STEPS (40), ACCUM (1: accelerate's gradient_accumulation_steps), BARRIER_EVERY (0:
accelerator.wait_for_everyone() every that many steps), BATCH (8).
"""

import os

import torch
import torch.nn as nn
from accelerate import Accelerator


def main():
    steps, accum = int(os.environ.get("STEPS", "40")), int(os.environ.get("ACCUM", "1"))
    barrier_every, batch = int(os.environ.get("BARRIER_EVERY", "0")), int(os.environ.get("BATCH", "8"))
    accelerator = Accelerator(gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * accum * batch * 2, 10), torch.randn(steps * accum * batch * 2, 5)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done = 0
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)  # FORWARD
            accelerator.backward(loss)  # BACKWARD
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if barrier_every and done % barrier_every == 0:
                accelerator.wait_for_everyone()  # BARRIER
            if done >= steps:
                break
    accelerator.end_training()
    print(f"rank {accelerator.process_index} done", flush=True)


if __name__ == "__main__":
    main()
