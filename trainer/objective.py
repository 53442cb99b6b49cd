"""The diffusion training objective: what one micro-batch's forward, loss and backward are.

`prepare(batch)` moves a loader batch to the device and draws every random number of the step
(posterior noise, diffusion noise, timesteps, caption dropout) for the whole batch at once, from
one generator per rank. `forward_backward(model, micro_batch, loss_scale)` then only computes, so
cutting a batch into micro-batches changes nothing but the order of summation, and a checkpoint
of the generator makes resumption exact.

Batches come in two forms (trainer/data.py and trainer/cache.py):
    uncached: pixel_values [B,3,H,W] in [-1,1], caption [str]     -> VAE + text encoder per step
    cached:   latent_mean, latent_std [B,C,h,w], encoder_hidden_states [B,L,D]

When the text encoder's LoRA adapters train (lora.text_encoder), the captions are tokenized in
both forms and the model the step calls is `TextConditioned` (encoder + UNet): it takes the token
ids, a dropped caption's replaced by those of "", and the encoder runs with gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sddoctor.instrument import api as sdi
from trainer.config import Config
from trainer.lora import text_encoder_trains
from trainer.models import Models
from trainer.vae_encode import encode_in_calls
from trainer.vae_fit import latent_shape


def tokenize(captions: list[str], tokenizer: Any, device: torch.device) -> torch.Tensor:
    ids = tokenizer(
        list(captions),
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    return ids.to(device, non_blocking=True)


class DiffusionObjective:
    def __init__(
        self,
        cfg: Config,
        models: Models,
        device: torch.device,
        dtype: torch.dtype,
        frozen_dtype: torch.dtype,
        generator: torch.Generator,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.cfg = cfg
        self.models = models
        self.device = device
        self.dtype = dtype
        self.frozen_dtype = frozen_dtype
        self.generator = generator
        self.scaler = scaler
        scheduler = models.noise_scheduler
        # Noise-schedule table on the device: indexing it with device timesteps needs no host sync.
        self.alphas_cumprod = scheduler.alphas_cumprod.to(device=device, dtype=torch.float32)
        self.prediction_type = scheduler.config.prediction_type
        self.num_timesteps = scheduler.config.num_train_timesteps
        self.scaling = float(models.vae.config.scaling_factor)
        self.text_trains = text_encoder_trains(cfg.lora)
        # The caption "" that replaces dropped captions (classifier-free guidance).
        self.empty_ids = tokenize([""], models.tokenizer, device)
        with torch.no_grad():
            self.empty_embedding = models.text_encoder(self.empty_ids)[0].to(frozen_dtype)
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device.type, dtype=dtype))
            if dtype in (torch.float16, torch.bfloat16)
            else contextlib.nullcontext
        )

    def prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Move a batch to the device and draw all of the step's randomness for it at once."""
        device, gen, train = self.device, self.generator, self.cfg.train
        out: dict[str, Any] = {}
        if "latent_mean" in batch:
            out["latent_mean"] = batch["latent_mean"].to(device, non_blocking=True).float()
            out["latent_std"] = batch["latent_std"].to(device, non_blocking=True).float()
            if not self.text_trains:
                out["encoder_hidden_states"] = batch["encoder_hidden_states"].to(device, non_blocking=True)
            shape = tuple(out["latent_mean"].shape)
        else:
            pixels = batch["pixel_values"].to(device, non_blocking=True)
            out["pixel_values"] = pixels
            shape = latent_shape(self.models.vae, pixels.shape)
        if self.text_trains or "latent_mean" not in batch:
            out["input_ids"] = tokenize(batch["caption"], self.models.tokenizer, device)
        b = shape[0]
        out["latent_noise"] = torch.randn(shape, generator=gen, device=device)
        noise = torch.randn(shape, generator=gen, device=device)
        if train.noise_offset:
            offset = torch.randn((b, shape[1], 1, 1), generator=gen, device=device)
            noise = noise + train.noise_offset * offset
        out["noise"] = noise
        out["timesteps"] = torch.randint(0, self.num_timesteps, (b,), generator=gen, device=device)
        out["drop_caption"] = torch.rand((b,), generator=gen, device=device) < train.caption_dropout
        return out

    def forward_backward(self, model: torch.nn.Module, mb: dict[str, Any], loss_scale: float) -> torch.Tensor:
        """Forward, loss and backward of loss * loss_scale for one micro-batch; returns the detached loss."""
        sdi.phase("forward")
        models, train = self.models, self.cfg.train
        with torch.no_grad():
            if "latent_mean" in mb:
                latents = mb["latent_mean"] + mb["latent_std"] * mb["latent_noise"]
            else:
                mean, std = encode_in_calls(models.vae, mb["pixel_values"].to(self.frozen_dtype))
                latents = mean.float() + std.float() * mb["latent_noise"]
            latents = latents * self.scaling
            condition = self._condition(mb)
            t = mb["timesteps"]
            ab = self.alphas_cumprod[t][:, None, None, None]
            noisy = ab.sqrt() * latents + (1 - ab).sqrt() * mb["noise"]
            if self.prediction_type == "v_prediction":
                target = ab.sqrt() * mb["noise"] - (1 - ab).sqrt() * latents
            else:
                target = mb["noise"]
            if self.cfg.model.channels_last:
                noisy = noisy.contiguous(memory_format=torch.channels_last)
        with self.autocast():
            pred = model(noisy, t, condition).sample
        per_sample = F.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
        if train.min_snr_gamma > 0:
            snr = ab.flatten() / (1 - ab.flatten())
            clipped = snr.clamp(max=train.min_snr_gamma)
            weight = clipped / (snr + 1) if self.prediction_type == "v_prediction" else clipped / snr
            per_sample = per_sample * weight
        loss = per_sample.mean()
        sdi.phase("backward")
        scaled = loss * loss_scale
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def _condition(self, mb: dict[str, Any]) -> torch.Tensor:
        """What the model is conditioned on, dropped captions replaced by "": the token ids when the
        text encoder trains (it runs inside the model), else the frozen encoder's hidden states."""
        drop = mb["drop_caption"]
        if self.text_trains:
            return torch.where(drop[:, None], self.empty_ids, mb["input_ids"])
        if "encoder_hidden_states" in mb:
            hidden = mb["encoder_hidden_states"]
        else:
            hidden = self.models.text_encoder(mb["input_ids"])[0]
        hidden = hidden.to(self.frozen_dtype)
        return torch.where(drop[:, None, None], self.empty_embedding, hidden)
