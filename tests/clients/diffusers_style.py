"""A text-to-image fine-tuning loop in the style of diffusers' train_text_to_image.py, on a tiny
UNet2DConditionModel, with plain DDP under torchrun (caption embeddings stand in for a text encoder).

torchrun --nproc-per-node 2 diffusers_style.py
Environment: STEPS (20), ACCUM (1), BARRIER_EVERY (0), BATCH (4).
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    unet = DDP(unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    steps, accum = int(os.environ.get("STEPS", "20")), int(os.environ.get("ACCUM", "1"))
    barrier_every, batch = int(os.environ.get("BARRIER_EVERY", "0")), int(os.environ.get("BATCH", "4"))
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        for micro in range(accum):
            sync = contextlib.nullcontext() if micro == accum - 1 else unet.no_sync()
            with sync:
                latents = torch.randn(batch, 4, 8, 8, generator=generator)
                encoder_hidden_states = torch.randn(batch, 7, 16, generator=generator)
                noise = torch.randn_like(latents)
                timesteps = torch.randint(
                    0, noise_scheduler.config.num_train_timesteps, (batch,), generator=generator
                )
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample  # FORWARD
                loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
                loss.backward()  # BACKWARD
        optimizer.step()
        optimizer.zero_grad()
        if barrier_every and step % barrier_every == 0:
            dist.barrier()  # BARRIER
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
