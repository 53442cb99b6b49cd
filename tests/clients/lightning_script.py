"""A PyTorch Lightning model trained with strategy="ddp" on CPU, launched by torchrun.

torchrun --nproc-per-node 2 lightning_script.py
Environment: STEPS (40), ACCUM (1: accumulate_grad_batches), BATCH (8), VAL_EVERY (0: no validation;
N validates every N training batches, after Lightning's sanity check).
"""

import os

import lightning as L
import torch
import torch.nn as nn


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)  # TRAINING_STEP

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    steps, accum, batch = (
        int(os.environ.get("STEPS", "40")),
        int(os.environ.get("ACCUM", "1")),
        int(os.environ.get("BATCH", "8")),
    )
    torch.manual_seed(0)
    n = steps * accum * batch * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 10), torch.randn(n, 5))
    val_every = int(os.environ.get("VAL_EVERY", "0"))
    validation = {"val_check_interval": val_every} if val_every else {"limit_val_batches": 0}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        accumulate_grad_batches=accum,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **validation,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    val_loader = torch.utils.data.DataLoader(data, batch_size=batch) if val_every else None
    trainer.fit(Regressor(), loader, val_loader)  # FIT
    print(f"rank {trainer.global_rank} done", flush=True)


if __name__ == "__main__":
    main()
