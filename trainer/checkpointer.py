"""What a checkpoint of a training run holds: saving it at points every rank agrees on, restoring it.

The format (safetensors + JSON, per-rank parts, fallback to an older intact checkpoint) is
trainer/checkpoint.py's; this module decides what goes in: the UNet, optimizer, LR schedule, EMA,
loss scaler, data position, the OOM guard's setting, the fitted VAE and a text encoder trained
from scratch (shared), and each rank's random generators and sampler (per rank).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sddoctor.instrument import api as sdi
from sddoctor.telemetry.schema import EventKind
from trainer.checkpoint import (
    CheckpointError,
    Resume,
    fresh_rng_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import to_dict
from trainer.lora import load_text_encoder_state, load_unet_state, text_encoder_state, unet_state
from trainer.models import Models
from trainer.process import barrier

if TYPE_CHECKING:
    from trainer.build import Run


class Checkpointer:
    def __init__(self, run: Run, log: Callable[[str], None]) -> None:
        self.run = run
        self.log = log

    def shared_state(self) -> dict[str, Any]:
        """What every rank holds alike (rank 0 writes it)."""
        run = self.run
        state = {
            "step": run.step,
            **unet_state(run.models.unet, run.lora_base),
            **text_encoder_state(run.models.text_encoder, run.text_lora_base),
            "optimizer": run.optimizer.state_dict(),
            "lr_scheduler": run.lr_scheduler.state_dict(),
            "ema": run.ema.state_dict() if run.ema is not None else None,
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "samplers": [run.sampler.state_dict()],
            "config": to_dict(run.cfg),
            "oom_guard": run.train_step.state_dict(),
        }
        if run.fitted_vae:
            state["vae"] = run.models.vae.state_dict()
            state["vae_scaling_factor"] = run.scaling
        if run.models.from_scratch:
            state["text_encoder"] = run.models.text_encoder.state_dict()
        return state

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: the random generators and the data position."""
        run = self.run
        return {"rng": rng_state(run.generator), "sampler": run.sampler.state_dict(), "step": run.step}

    def save(self, reason: str) -> None:
        """Every rank: settle the last step, check it is finite, write the checkpoint together."""
        run = self.run
        run.train_step.settle(run.step)
        run.train_step.check_finite()
        t0 = time.time()
        path = save_checkpoint(
            run.ckpt_root,
            run.step,
            self.shared_state,
            self.rank_state(),
            run.dist.rank,
            run.dist.world_size,
            barrier,
            keep=run.cfg.checkpoint.keep,
        )
        seconds = time.time() - t0
        sdi.event(EventKind.CHECKPOINT, step=run.step, path=str(path), seconds=seconds, reason=reason)
        self.log(f"checkpoint {path} ({reason}, {seconds:.1f}s)")


def restore_frozen(models: Models, shared: dict[str, Any], path: Path) -> None:
    """The fitted VAE and a text encoder trained from scratch, before the latent cache is built."""
    with checkpoint_must_fit(path):
        if "vae" in shared:
            models.vae.load_state_dict(shared["vae"])
            models.vae.register_to_config(scaling_factor=float(shared["vae_scaling_factor"]))
        if "text_encoder" in shared:
            models.text_encoder.load_state_dict(shared["text_encoder"])


def restore_training(
    resume: Resume,
    shared: dict[str, Any],
    rank_state: dict[str, Any] | None,
    trained: dict[str, Any],
    generator: torch.Generator,
    seed: int,
    rank: int,
    lora_bases: tuple[str | None, str | None] = (None, None),
) -> int:
    """Load the UNet, optimizer, schedule, EMA, scaler and sampler (`trained`, by name; None where
    the run has none) and the random generators; returns the step to continue from. `lora_bases`:
    the fingerprints of the UNet and text encoder that LoRA adapters were added to (None: none).

    Without this rank's part (a re-sharded checkpoint) the data position is the shared one and
    the random streams start afresh from the seed and the step.
    """
    with checkpoint_must_fit(resume.path):
        load_unet_state(trained["unet"], shared, lora_bases[0])
        load_text_encoder_state(trained["text_encoder"], shared, lora_bases[1])
        trained["optimizer"].load_state_dict(shared["optimizer"])
        trained["lr_scheduler"].load_state_dict(shared["lr_scheduler"])
        if trained["ema"] is not None and shared.get("ema") is not None:
            trained["ema"].load_state_dict(shared["ema"])
        if trained["scaler"] is not None and shared.get("scaler") is not None:
            trained["scaler"].load_state_dict(shared["scaler"])
        step = int(shared["step"])
        trained["sampler"].load_state_dict(
            shared["samplers"][0] if rank_state is None else rank_state["sampler"]
        )
    if rank_state is not None:
        set_rng_state(rank_state["rng"], generator)
    else:
        fresh_rng_state(seed, step, rank, generator)
    return step


@contextlib.contextmanager
def checkpoint_must_fit(path: Path) -> Iterator[None]:
    """A checkpoint of another model or configuration is bad input (exit 2), not a crash."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or "no detail"
        raise CheckpointError(
            f"checkpoint {path} does not fit this run ({type(exc).__name__}: {detail[:300]}); resume it "
            "with the preset, model and optimizer settings it was saved with"
        ) from None
