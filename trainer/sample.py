"""Sample grids: fixed prompts, one row per prompt, saved as a PNG in the run directory.

`SampleGrids` is what the training loop calls on rank 0 (the other ranks wait at a barrier): the
EMA weights swapped in, frozen models brought back from host memory when they were offloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from trainer.config import SampleConfig
from trainer.models import Models
from trainer.optim import EMA


def build_pipeline(models: Models, unet: torch.nn.Module) -> Any:
    """A StableDiffusionPipeline over the training modules (no copy), with a DDIM sampler."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=models.vae,
        text_encoder=models.text_encoder,
        tokenizer=models.tokenizer,
        unet=unet,
        scheduler=DDIMScheduler.from_config(models.noise_scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


class SampleGrids:
    """The grid of `sample.prompts` with the training UNet, saved as samples/step-N.png."""

    def __init__(
        self,
        cfg: SampleConfig,
        resolution: int,
        models: Models,
        ema: EMA | None,
        device: torch.device,
        dtype: torch.dtype,
        offloaded: bool,
        out_dir: Path,
    ) -> None:
        self.cfg = cfg
        self.resolution = resolution
        self.models = models
        self.ema = ema
        self.device = device
        self.dtype = dtype
        self.offloaded = offloaded
        self.out_dir = out_dir

    def __call__(self, step: int) -> tuple[Image.Image, Path]:
        """(the grid, where it was saved); every rank has settled the step before this."""
        models, cfg = self.models, self.cfg
        if self.offloaded:
            models.vae.to(self.device)
            models.text_encoder.to(self.device)
        with ema_weights(models.unet, self.ema):
            grid = sample_grid(
                models,
                models.unet,
                cfg.prompts,
                cfg.images_per_prompt,
                cfg.steps,
                cfg.guidance_scale,
                self.resolution,
                cfg.seed,
                self.device,
                self.dtype,
            )
        if self.offloaded:
            models.vae.to("cpu")
            models.text_encoder.to("cpu")
        return grid, save_grid(grid, self.out_dir, step)


@contextlib.contextmanager
def ema_weights(unet: torch.nn.Module, ema: EMA | None) -> Iterator[None]:
    """Temporarily load the EMA weights into `unet` (no-op without EMA)."""
    if ema is None:
        yield
        return
    backup = [p.detach().clone() for p in ema.params]
    ema.copy_to(unet)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(ema.params, backup, strict=True):
                p.copy_(b)


@torch.no_grad()
def sample_grid(
    models: Models,
    unet: torch.nn.Module,
    prompts: list[str],
    images_per_prompt: int,
    steps: int,
    guidance_scale: float,
    resolution: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Image.Image:
    """Generate `images_per_prompt` images for each prompt; rows = prompts."""
    pipe = build_pipeline(models, unet)
    pipe.set_progress_bar_config(disable=True)
    # Eval mode (no LoRA dropout) for both: the text encoder trains too with lora.text_encoder.
    was_training = [(module, module.training) for module in (unet, models.text_encoder)]
    unet.eval()
    models.text_encoder.eval()
    rows = []
    try:
        for index, prompt in enumerate(prompts):
            generator = torch.Generator(device=device).manual_seed(seed + index)
            autocast = (
                torch.autocast(device.type, dtype=dtype)
                if dtype in (torch.float16, torch.bfloat16)
                else contextlib.nullcontext()
            )
            with autocast:
                out = pipe(
                    [prompt] * images_per_prompt,
                    num_inference_steps=steps,
                    guidance_scale=guidance_scale,
                    height=resolution,
                    width=resolution,
                    generator=generator,
                    output_type="pil",
                )
            rows.append(out.images)
    finally:
        for module, mode in was_training:
            module.train(mode)
    return make_grid(rows)


def make_grid(rows: list[list[Image.Image]], pad: int = 2) -> Image.Image:
    width, height = rows[0][0].size
    columns = max(len(r) for r in rows)
    grid = Image.new("RGB", (columns * (width + pad) + pad, len(rows) * (height + pad) + pad), "white")
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            grid.paste(image, (pad + x * (width + pad), pad + y * (height + pad)))
    return grid


def save_grid(grid: Image.Image, out_dir: Path, step: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"step-{step:08d}.png"
    grid.save(path)
    (out_dir / "latest.png").write_bytes(path.read_bytes())
    return path
