"""An accelerate training script with epochs: gradient accumulation through
`accelerator.accumulate`, an evaluation loop each epoch whose predictions are collected with
`accelerator.gather_for_metrics`, and `accelerator.save_state` every few optimizer steps.

ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 accelerate_epochs.py
Environment: EPOCHS (3), STEPS_PER_EPOCH (4: optimizer steps), ACCUM (2), BATCH (8),
SAVE_EVERY (3 optimizer steps), OUT (the checkpoint folder, ./checkpoints).
"""

import os

import torch
import torch.nn as nn
from accelerate import Accelerator


def loaders(steps_per_epoch, accum, batch):
    torch.manual_seed(0)
    n = steps_per_epoch * accum * batch * 2  # two ranks
    train = torch.utils.data.TensorDataset(torch.randn(n, 10), torch.randint(0, 3, (n,)))
    val = torch.utils.data.TensorDataset(torch.randn(20, 10), torch.randint(0, 3, (20,)))  # uneven split
    return (
        torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True),
        torch.utils.data.DataLoader(val, batch_size=batch),
    )


def evaluate(accelerator, model, val_loader):
    model.eval()
    correct = total = 0
    for inputs, labels in val_loader:
        with torch.no_grad():
            predictions = model(inputs).argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))  # GATHER
        correct += (predictions == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total, total


def main():
    epochs, steps_per_epoch = int(os.environ.get("EPOCHS", "3")), int(os.environ.get("STEPS_PER_EPOCH", "4"))
    accum, batch = int(os.environ.get("ACCUM", "2")), int(os.environ.get("BATCH", "8"))
    save_every, out = int(os.environ.get("SAVE_EVERY", "3")), os.environ.get("OUT", "checkpoints")
    accelerator = Accelerator(gradient_accumulation_steps=accum)
    train_loader, val_loader = loaders(steps_per_epoch, accum, batch)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader
    )
    done = 0
    for epoch in range(epochs):
        model.train()
        for inputs, labels in train_loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(inputs), labels)  # FORWARD
                accelerator.backward(loss)  # BACKWARD
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                done += 1
                if done % save_every == 0:
                    accelerator.save_state(os.path.join(out, f"step-{done}"))  # SAVE
        accuracy, seen = evaluate(accelerator, model, val_loader)  # EVAL
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f} on {seen} samples")
    accelerator.end_training()
    print(f"rank {accelerator.process_index} done after {done} steps", flush=True)


if __name__ == "__main__":
    main()
