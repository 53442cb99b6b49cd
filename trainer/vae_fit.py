"""Fitting a randomly initialised VAE before the UNet trains on its latents.

A preset built from scratch has a random VAE: its latents carry little of the image and its
decoder turns anything into noise, so samples would be noise however well the UNet learns.
`fit_vae` trains the VAE for `model.vae_warmup_steps` steps on the training images
(reconstruction MSE + a small KL term), data-parallel over all ranks, and then sets the
latent scaling factor so latents have unit variance, as Stable Diffusion's 0.18215 does for its
VAE. Every rank ends with identical weights (DDP) and the same scaling factor (broadcast).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.data import ResumableDistributedSampler, build_dataloader
from trainer.models import vae_scale_factor
from trainer.nonfinite import NonFiniteError, NonFiniteWatch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL


def fit_vae(
    vae: AutoencoderKL,
    dataset: torch.utils.data.Dataset,
    steps: int,
    batch_size: int,
    lr: float,
    kl_weight: float,
    device: torch.device,
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    rank: int,
    world_size: int,
    seed: int,
    log: Callable[[str], None],
) -> float:
    """Train `vae` in place for `steps` steps; returns the final reconstruction loss (all-rank mean).

    A batch larger than a rank's share of the data shrinks to that share (every rank alike: the
    shares are equal), so each epoch yields at least one step. NonFiniteError (on every rank) if
    the reconstruction loss stops being finite.
    """
    vae.train()
    vae.requires_grad_(True)
    model = wrap(_Reconstruction(vae))
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sampler = ResumableDistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed + 7919)
    if batch_size > sampler.num_samples:
        log(
            f"vae fit: batch {batch_size} is more than the {sampler.num_samples} images per rank; "
            f"using {sampler.num_samples} (model.vae_warmup_batch)"
        )
        batch_size = sampler.num_samples
    loader = build_dataloader(dataset, sampler, batch_size, num_workers=0, seed=seed + 7919)
    if len(loader) == 0:  # cannot happen after the clamp; an endless loop must never be the result
        raise RuntimeError(f"vae fit: no batch of {batch_size} in {sampler.num_samples} images per rank")
    watch = NonFiniteWatch(device, rank, world_size)
    generator = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    start = time.time()
    step, epoch = 0, 0
    recent = torch.zeros((), device=device)
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            pixels = batch["pixel_values"].to(device, non_blocking=True)
            eps = torch.randn(latent_shape(vae, pixels.shape), generator=generator, device=device)
            reconstruction, kl = model(pixels, eps)
            loss = F.mse_loss(reconstruction.float(), pixels.float())
            # The KL term keeps latents near N(0, 1) so the diffusion model sees a well-scaled space.
            (loss + kl_weight * kl).backward()
            watch.observe(step + 1, loss=loss + kl_weight * kl)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recent = 0.9 * recent + 0.1 * loss.detach() if step else loss.detach()
            step += 1
            if rank == 0 and (step % 50 == 0 or step == steps):
                log(f"vae fit {step}/{steps} | recon mse {recent.item():.4f} | {time.time() - start:.1f}s")
            if step >= steps:
                break
        epoch += 1
    vae.eval()
    vae.requires_grad_(False)
    watch.check(
        None,
        "the VAE fit",
        f"Lower model.vae_warmup_lr (now {lr:g}) or model.vae_kl_weight (now {kl_weight:g})",
    )
    if world_size > 1:
        dist.all_reduce(recent)
        recent /= world_size
        _broadcast_weights(vae, rank, log)
    _set_scaling_factor(vae, dataset, device, batch_size)
    if not math.isfinite(vae.config.scaling_factor) or vae.config.scaling_factor <= 0:
        raise NonFiniteError(
            f"the VAE fit diverged: its latents are not finite numbers (scaling factor "
            f"{vae.config.scaling_factor}); stopped without saving. Lower model.vae_warmup_lr (now {lr:g})"
        )
    return float(recent)


@torch.no_grad()
def _broadcast_weights(vae: AutoencoderKL, rank: int, log: Callable[[str], None]) -> None:
    """Make every rank hold rank 0's weights bit for bit (the cache key hashes them)."""
    worst = torch.zeros((), device=next(vae.parameters()).device)
    for tensor in vae.state_dict().values():
        reference = tensor.clone()
        dist.broadcast(reference, src=0)
        worst = torch.maximum(worst, (reference.float() - tensor.float()).abs().max())
        tensor.copy_(reference)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst.item() > 0:
        log(f"vae fit: ranks drifted apart by up to {worst.item():.3g}; all now hold rank 0's weights")


def latent_shape(vae: AutoencoderKL, pixel_shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int, int]:
    """Shape of the latents `vae` makes of images of `pixel_shape` (B, 3, H, W)."""
    factor = vae_scale_factor(vae)
    b, _, h, w = pixel_shape
    return (b, vae.config.latent_channels, h // factor, w // factor)


class _Reconstruction(torch.nn.Module):
    """encode -> sample (with given noise) -> decode, plus the KL term: one module for DDP to wrap."""

    def __init__(self, vae: AutoencoderKL) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, pixels: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        posterior = self.vae.encode(pixels).latent_dist
        latents = posterior.mean + posterior.std * eps
        return self.vae.decode(latents).sample, posterior.kl().mean()


@torch.no_grad()
def _set_scaling_factor(vae: AutoencoderKL, dataset, device: torch.device, batch_size: int) -> None:
    """scaling_factor = 1 / std of latent means over the first images (same on every rank)."""
    count = min(len(dataset), 512)
    latents = []
    for start in range(0, count, batch_size):
        pixels = torch.stack(
            [dataset[i]["pixel_values"] for i in range(start, min(count, start + batch_size))]
        )
        latents.append(vae.encode(pixels.to(device)).latent_dist.mean.float())
    std = torch.cat(latents).std()
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(std, src=0)
    vae.register_to_config(scaling_factor=float(1.0 / std.clamp_min(1e-6)))
