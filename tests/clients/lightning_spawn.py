"""A LightningModule trained with strategy="ddp_spawn" on CPU, started with plain `python`: the
Trainer spawns the two ranks itself. It validates every VAL_EVERY batches and logs its losses
with sync_dist=True (an all-reduce per logged value).

python lightning_spawn.py
Environment: STEPS (40), BATCH (8), VAL_EVERY (4), MASTER_PORT (Lightning picks one when unset).
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
        loss = nn.functional.mse_loss(self.net(inputs), targets)  # TRAINING_STEP
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)  # VALIDATION

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "8"))
    val_every = int(os.environ.get("VAL_EVERY", "4"))
    torch.manual_seed(0)
    n = steps * batch * 2
    data = torch.utils.data.TensorDataset(torch.randn(n, 10), torch.randn(n, 5))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=steps,
        val_check_interval=val_every,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    val_loader = torch.utils.data.DataLoader(data, batch_size=batch)
    trainer.fit(Regressor(), loader, val_loader)  # FIT
    print(f"rank {trainer.global_rank} done", flush=True)


if __name__ == "__main__":
    main()
