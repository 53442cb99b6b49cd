"""Optimizer, learning-rate schedule and EMA of the UNet weights."""

from __future__ import annotations

import inspect
import math

import torch

from trainer.config import OptimConfig


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW; the fused kernel on CUDA unless `optim.fused` says otherwise (one launch for all tensors)."""
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "true"
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps)
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
    """Exponential moving average of a module's parameters, kept in fp32 on the same device."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        current = [p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        targets = [p for p in module.parameters() if p.requires_grad]
        for target, value in zip(targets, self.shadow, strict=True):
            target.copy_(value)

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        for target, value in zip(self.shadow, state["shadow"], strict=True):  # type: ignore[arg-type]
            target.copy_(value)
