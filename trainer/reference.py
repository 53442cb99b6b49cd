"""The reference loop: Stable Diffusion fine-tuning written the way diffusers' train_text_to_image.py does it.

It is the baseline `python -m trainer.bench` measures the bundled trainer against, on the same
model, batch, resolution and precision:

- the UNet stays fp32 and runs under bf16 autocast (what accelerate's mixed_precision="bf16" does);
- the VAE and the text encoder are cast to bf16 and run on every step (no cached latents);
- `latents = vae.encode(pixels).latent_dist.sample() * scaling_factor`, DDPM `add_noise`, MSE
  loss in fp32, backward, gradient clipping, `torch.optim.AdamW` (its default implementation),
  LR scheduler step, `zero_grad`;
- the loss is read back every step for logging (`loss.item()`, one host sync per step), as the
  script does through `accelerator.gather(...).mean().item()`;
- contiguous (not channels_last) tensors, no torch.compile, default DDP settings.

Run it on its own (`python -m trainer.reference --preset sd2-base --batch 16 --steps 20`) or under
torchrun for several GPUs; `--json-out FILE` writes the measurement (rank 0):

    {"loop": "reference", "world_size", "batch", "steps", "warmup", "seconds", "it_s",
     "images_s", "mem_peak" (bytes, max over ranks), "attention": processor class name, ...}

Timing: after `--warmup` steps the device is synchronised and the clock starts; it stops after
`--steps` more steps and another synchronisation, so the figure is wall-clock throughput.
Peak memory is `torch.cuda.max_memory_allocated` over the timed steps (reset after warm-up).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.data import DataConfig, build_dataloader, build_dataset
from trainer.models import build_models

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.reference",
        description="diffusers train_text_to_image-style training loop, timed (the bench's baseline).",
        epilog="examples:\n  python -m trainer.reference --preset sd2-base --batch 16 --steps 20\n"
        "  torchrun --nproc-per-node 2 -m trainer.reference --preset tiny --batch 8 --json-out ref.json\n\n"
        "exit codes: 0 done, 1 failed (traceback), 2 bad arguments",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", help="tiny | sd15 | sd2-base")
    parser.add_argument("--resolution", type=int, default=0, help="pixels (default: the preset's)")
    parser.add_argument("--batch", type=int, default=4, help="images per GPU per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--num-workers", type=int, default=4, help="DataLoader workers per rank")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--json-out", metavar="FILE", help="write the measurement as JSON (rank 0)")
    args = parser.parse_args(argv)
    for name in ("batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def default_resolution(preset: str) -> int:
    return 32 if preset == "tiny" else 512


def _init_distributed(device: torch.device) -> tuple[int, int]:
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=600))
    return dist.get_rank(), dist.get_world_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


# Over 80 lines on purpose: the baseline keeps the shape of diffusers' train_text_to_image.py, one
# function from set-up to the timed loop, so that it does what that script does and nothing more.
def run(args: argparse.Namespace) -> dict[str, Any]:
    _quiet_libraries()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rank, world_size = _init_distributed(device)
    mode = args.precision
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]
    resolution = args.resolution or default_resolution(args.preset)

    torch.manual_seed(0)
    # Random weights are created on the device directly: initialising 1.3B parameters on the
    # host takes longer than the measurement. The loop itself is what the script does.
    with torch.device(device):
        models = build_models(args.preset)
    unet, vae, text_encoder = models.unet, models.vae, models.text_encoder
    noise_scheduler, tokenizer = models.noise_scheduler, models.tokenizer
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.to(device)  # fp32 master weights, as in the script
    vae.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    attention = sorted({type(p).__name__ for p in unet.attn_processors.values()})

    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model: torch.nn.Module = unet
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            unet, device_ids=[device.index] if device.type == "cuda" else None
        )

    total_steps = args.warmup + args.steps
    samples = max(args.batch * world_size * 2, 64)
    data_cfg = DataConfig(source="digits", resolution=resolution, max_samples=samples, num_workers=0)
    dataset = build_dataset(data_cfg, seed=0, verbose=False)
    sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True
    )
    loader = build_dataloader(
        dataset, sampler, args.batch, num_workers=args.num_workers, pin_memory=device.type == "cuda"
    )
    autocast = torch.autocast(device.type, dtype=weight_dtype, enabled=weight_dtype != torch.float32)

    unet.train()
    step, epoch, started = 0, 0, 0.0
    losses: list[float] = []
    while step < total_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == args.warmup:
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            input_ids = tokenizer(
                list(batch["caption"]),
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids.to(device)
            latents = vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample()
            latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device)
            timesteps = timesteps.long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
            if noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                target = noise
            with autocast:
                model_pred = model(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            avg_loss = loss.detach().clone()
            if world_size > 1:
                dist.all_reduce(avg_loss)
                avg_loss /= world_size
            losses.append(avg_loss.item())  # the script logs the step's loss: a host sync each step
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step >= total_steps:
                break
        epoch += 1
    _sync(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if world_size > 1 and peak is not None:
        peak_t = torch.tensor([peak], device=device, dtype=torch.float64)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = int(peak_t.item())
    it_s = args.steps / seconds
    result = {
        "loop": "reference",
        "preset": args.preset,
        "resolution": resolution,
        "world_size": world_size,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "seconds": seconds,
        "it_s": it_s,
        "images_s": it_s * args.batch * world_size,
        "mem_peak": peak,
        "precision": mode,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "attention": attention,
        "gradient_checkpointing": args.gradient_checkpointing,
        "final_loss": losses[-1],
    }
    if world_size > 1:
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preset not in ("tiny", "sd15", "sd2-base", "sd2"):
        print(
            f"reference: error: unknown preset {args.preset!r}; valid: tiny, sd15, sd2-base, sd2",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.json_out:
            Path(args.json_out).write_text(line + "\n", encoding="utf-8")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
