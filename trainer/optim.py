"""Optimizer, learning-rate schedule and EMA of the UNet weights."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from trainer.config import ConfigError, OptimConfig
from trainer.memory import Float32Workspace, MixedPrecisionAdamW, chunk_slices, stochastic_round_staged


class OptimizerUnavailable(ConfigError):
    """An optimizer this machine cannot run (8-bit AdamW without CUDA or bitsandbytes). Exit code 2."""


def check_optimizer(cfg: OptimConfig, device: torch.device) -> None:
    """OptimizerUnavailable when `optim.name` cannot run here: called once the device is known,
    before data or models are built, so that the run stops at once with the fix."""
    if cfg.name != "adamw8bit":
        return
    if device.type != "cuda":
        raise OptimizerUnavailable(
            f"optim.name=adamw8bit needs a CUDA GPU (bitsandbytes' 8-bit AdamW) and this run is on "
            f"{device.type}: use optim.name=adamw, or save optimizer memory with optim.state_dtype=bf16 "
            "or train.memory_saver=true"
        )
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - missing, or installed without a usable CUDA library
        raise OptimizerUnavailable(
            f"optim.name=adamw8bit needs bitsandbytes ({type(exc).__name__}: {str(exc)[:120]}): "
            "pip install 'sddoctor[bnb]' (or pip install bitsandbytes), or use optim.name=adamw"
        ) from None


#: Parameters, or parameter groups with their own settings (e.g. a learning rate of their own).
Params = list[torch.nn.Parameter] | list[dict[str, Any]]


def build_training_optimizer(
    params: Params, cfg: OptimConfig, device: torch.device, bf16_weights: bool
) -> torch.optim.Optimizer:
    """The trainer's optimizer for `params`, as `optim.*` and the UNet's weight dtype ask:

    adamw8bit       bitsandbytes' AdamW8bit (fp32 weights; 8-bit moments, block-wise quantised)
    bf16 weights or bf16 moments
                    MixedPrecisionAdamW (fp32 master copy, or bf16 moments + stochastic rounding)
    otherwise       torch's AdamW (fused on CUDA)
    """
    if cfg.name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if bf16_weights or cfg.state_dtype == "bf16":
        return MixedPrecisionAdamW(
            params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            master_weights=cfg.master_weights,
            state_dtype=torch.bfloat16 if cfg.state_dtype == "bf16" else torch.float32,
            fused=None if cfg.fused == "auto" else cfg.fused == "true",
        )
    return build_optimizer(params, cfg, device)


def build_optimizer(
    params: Params, cfg: OptimConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW; the fused kernel on CUDA unless `optim.fused` says otherwise (one launch for all tensors)."""
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "true"
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)
    if fused and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["fused"] = True
    elif device.type == "cuda":
        kwargs["foreach"] = True
    return torch.optim.AdamW(params, **kwargs)


class WarmupSchedule:
    """Multiplier of the base LR: linear warmup, then cosine decay to min_lr_ratio or constant."""

    def __init__(self, cfg: OptimConfig, max_steps: int) -> None:
        self.warmup = cfg.warmup_steps
        self.cosine = cfg.schedule == "cosine"
        self.floor = cfg.min_lr_ratio
        self.max_steps = max_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.cosine:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.max_steps - self.warmup))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupSchedule(cfg, max_steps))


class EMA:
    """Exponential moving average of a module's parameters, kept on the same device.

    The average is fp32 by default. `dtype=torch.bfloat16` halves it (1.7 GB instead of 3.5 GB for
    SD2-base; what `train.memory_saver` uses): with a decay of 0.9999 each step moves the average by
    1e-4 of the difference, far below bf16's resolution, so the update is computed in fp32 and
    rounded stochastically (as MixedPrecisionAdamW does without a master copy): unbiased, so the
    small moves add up on average instead of being rounded away. The update runs over chunks of
    `chunk_elements`, so its fp32 workspaces stay small whatever the model's size.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        decay: float,
        dtype: torch.dtype = torch.float32,
        chunk_elements: int = 1 << 25,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"EMA dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.decay = decay
        self.dtype = dtype
        self.chunk_elements = chunk_elements
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [p.detach().to(dtype=dtype, copy=True) for p in self.params]
        self._current32 = Float32Workspace()
        self._average32 = Float32Workspace()

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.decay
        for part in chunk_slices(self.params, self.chunk_elements):
            params, shadow = self.params[part], self.shadow[part]
            if all(p.dtype == torch.float32 for p in params):
                current = [p.detach() for p in params]
            else:  # one multi-tensor copy into a reused buffer, not a `.float()` per tensor
                current = self._current32.copy([p.detach() for p in params], like=params).views
            if self.dtype == torch.float32:
                torch._foreach_lerp_(shadow, current, weight)
                continue
            averaged = self._average32.copy(shadow, like=shadow)
            torch._foreach_lerp_(averaged.views, current, weight)
            stochastic_round_staged(shadow, averaged)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        targets = [p for p in module.parameters() if p.requires_grad]
        for target, value in zip(targets, self.shadow, strict=True):
            target.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for target, value in zip(self.shadow, state["shadow"], strict=True):
            target.copy_(value)
