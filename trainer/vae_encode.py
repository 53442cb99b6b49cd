"""Encoding images to the VAE's latent distribution in calls that fit in memory.

The VAE encoder's activations grow with the pixels of one call: SD's VAE at 512 px holds about
64 MiB per image in one bf16 tensor, and several such tensors are alive at once, so encoding a
cache batch of 64 images plus their flips asked for a single 4 GiB block and ran a 24 GiB card
out of memory although training at that batch fits. The encoder treats images independently,
so any split gives the same latents; the calls here hold at most `ENCODE_PIXELS` pixels, and
`FallbackEncoder` halves the call further when the GPU still runs out (another process,
a smaller card), down to one image.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

log = logging.getLogger("trainer.vae_encode")

# Pixels per VAE encode call: 16 images at 512x512. On SD2's VAE in bf16 that call peaks near
# 4 GiB, a fraction of any card the UNet trains on, and large enough to keep the GPU busy.
ENCODE_PIXELS = 16 * 512 * 512


def images_per_call(height: int, width: int, budget: int | None = None) -> int:
    """How many height x width images one encode call takes under `budget` pixels (default
    ENCODE_PIXELS), at least 1."""
    budget = ENCODE_PIXELS if budget is None else budget
    return max(1, budget // max(1, height * width))


def encode_in_calls(
    vae: AutoencoderKL, pixels: torch.Tensor, per_call: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the latent distribution of `pixels` [B,3,H,W], `per_call` images at a time
    (default: as many as the pixel budget allows)."""
    if per_call is None:
        per_call = images_per_call(pixels.shape[-2], pixels.shape[-1])
    dists = [vae.encode(chunk).latent_dist for chunk in pixels.split(per_call)]
    if len(dists) == 1:  # one call: no copy into a concatenation
        return dists[0].mean, dists[0].std
    return torch.cat([d.mean for d in dists]), torch.cat([d.std for d in dists])


class FallbackEncoder:
    """Encodes batch after batch, halving the images per call on CUDA out-of-memory and keeping
    the smaller size for later batches; re-raises when a single image does not fit."""

    def __init__(self, vae: AutoencoderKL) -> None:
        self.vae = vae
        self.per_call: int | None = None  # None: the pixel budget's size for each batch

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            per_call = self.per_call or images_per_call(pixels.shape[-2], pixels.shape[-1])
            per_call = min(per_call, pixels.shape[0])
            try:
                return encode_in_calls(self.vae, pixels, per_call)
            except torch.OutOfMemoryError:
                if per_call == 1:
                    raise
            # Retried outside the except block so the failed call's tensors are already freed.
            self.per_call = max(1, per_call // 2)
            if pixels.is_cuda:
                torch.cuda.empty_cache()
            log.warning(
                "VAE encode of %d images ran out of GPU memory; encoding %d at a time",
                per_call,
                self.per_call,
            )
