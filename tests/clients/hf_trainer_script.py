"""A model trained with Hugging Face transformers' Trainer, launched by torchrun (Trainer wraps it
in DDP itself; `use_cpu` and the gloo backend on a machine without a GPU).

torchrun --nproc-per-node 2 hf_trainer_script.py
Environment: STEPS (40: optimizer steps), ACCUM (1: gradient_accumulation_steps), BARRIER_EVERY
(0: a callback calls torch.distributed.barrier() every that many steps), BATCH (8 per device).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments


class Pairs(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(size, 10, generator=generator)
        self.targets = torch.randn(size, 5, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        return {"inputs": self.inputs[index], "labels": self.targets[index]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, inputs, labels=None):
        prediction = self.net(inputs)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


class BarrierEvery(TrainerCallback):
    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0:
            dist.barrier()  # BARRIER


def main():
    steps, accum = int(os.environ.get("STEPS", "40")), int(os.environ.get("ACCUM", "1"))
    barrier_every, batch = int(os.environ.get("BARRIER_EVERY", "0")), int(os.environ.get("BATCH", "8"))
    args = TrainingArguments(
        output_dir=os.environ.get("OUTPUT_DIR", "hf-trainer-out"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        max_steps=steps,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=Regressor(),
        args=args,
        train_dataset=Pairs(steps * accum * batch * 2 * 2),
        callbacks=[BarrierEvery(barrier_every)],
    )
    trainer.train()  # TRAIN
    print(f"rank {trainer.args.process_index} done", flush=True)


if __name__ == "__main__":
    main()
