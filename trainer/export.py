"""Export of the trained model as a diffusers folder.

The folder holds unet/, vae/, text_encoder/, tokenizer/, scheduler/ and model_index.json, so
both `StableDiffusionPipeline.from_pretrained(folder)` and `python -m trainer --model folder`
load it. With EMA on, the UNet written is the EMA one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from trainer.models import Models
from trainer.optim import EMA
from trainer.sample import build_pipeline, ema_weights


def export_pipeline(models: Models, unet: torch.nn.Module, out_dir: Path, ema: EMA | None = None) -> Path:
    """Write the diffusers folder atomically (temporary folder, then rename). Returns its path."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with ema_weights(unet, ema):
        pipe = build_pipeline(models, unet)
        pipe.save_pretrained(tmp, safe_serialization=True)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)
    return out_dir
