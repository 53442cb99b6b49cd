"""Everything the training loop works with, built in the order the pieces depend on each other.

    checkpoint to resume (agreed by all ranks) -> data -> models -> (fitted VAE, text encoder from
    the checkpoint) -> (VAE fit) -> (latent cache) -> sampler and loader -> optimizer, schedule,
    EMA, loss scaler -> (resume) -> DDP under the OOM guard -> objective

Bad input (a data folder, a --resume target) fails before any model is built. Model init is
identical on every rank (the frozen parts are never broadcast). The collectives of the set-up
(checkpoint agreement, VAE fit, latent cache, the guard's control group, DDP's broadcast) run in
this order on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sddoctor.instrument import api as sdi
from sddoctor.instrument.oom_guard import OOMGuard
from sddoctor.telemetry.schema import EventKind
from trainer.buckets import build_bucket_loader, check_bucket_settings, prepare_buckets
from trainer.cache import build_cache
from trainer.checkpoint import Resume, choose_checkpoint, find_latest, load_checkpoint
from trainer.checkpointer import restore_frozen, restore_training
from trainer.config import Config
from trainer.data import ResumableDistributedSampler, build_dataloader, build_dataset
from trainer.lora import (
    TextConditioned,
    add_lora,
    add_text_encoder_lora,
    describe_lora,
    keep_adapters_fp32,
    plain_text_encoder,
    text_encoder_trains,
)
from trainer.memory import CastInputs, unet_weights_bf16
from trainer.models import (
    Models,
    OnlyAttentionKernel,
    build_models,
    check_model_fits,
    compile_arguments,
    count_parameters,
    separate_compile_cache,
    side_step,
)
from trainer.nonfinite import NonFiniteWatch
from trainer.objective import DiffusionObjective
from trainer.optim import EMA, build_lr_scheduler, build_training_optimizer, check_optimizer
from trainer.process import Dist, gather
from trainer.step import OptimizerStep, TrainStep
from trainer.unet_layout import keep_channels_last
from trainer.vae_fit import fit_vae

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, UNet2DConditionModel

Log = Callable[[str], None]


class BadInput(Exception):
    """Wraps the user-input errors of every module; turns into exit code 2."""


@dataclass
class Run:
    """The pieces of a training run and the loop's position in it (`step`: optimizer steps done)."""

    cfg: Config
    dist: Dist
    out_dir: Path
    start_time: float
    dtype: torch.dtype
    """Autocast dtype of the step (fp32: none)."""
    frozen_dtype: torch.dtype
    models: Models
    sampler: ResumableDistributedSampler
    loader: Any
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    ema: EMA | None
    scaler: torch.amp.GradScaler | None
    generator: torch.Generator
    objective: DiffusionObjective
    fitted_vae: bool
    scaling: float
    """The VAE's latent scaling factor (fitted for a VAE built from scratch)."""
    offloaded: bool
    """The VAE and text encoder wait in host memory (cached latents need neither)."""
    lora_base: str | None = None
    """With LoRA: the base UNet's fingerprint (checkpoints hold only the adapters); None: the whole UNet trains."""
    text_lora_base: str | None = None
    """With lora.text_encoder: the base text encoder's fingerprint; None: the text encoder is frozen."""
    step: int = 0
    train_step: TrainStep = field(init=False)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def images_per_step(self) -> int:
        """The global batch: images of one optimizer step over all ranks."""
        return self.cfg.train.micro_batch * self.cfg.train.grad_accum * self.dist.world_size


def build_run(cfg: Config, d: Dist, out_dir: Path, log: Log, warn: Log) -> Run:
    """Build every piece of the run (collectives included), in order; the loop starts after this."""
    start_time = time.time()
    dtype = resolve_precision(cfg.train.mixed_precision, d.device)
    if d.device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    check_optimizer(cfg.optim, d.device)
    # Bad input (a --resume target, the data folder) fails here, before any model is built.
    resume = choose_checkpoint(
        cfg.checkpoint.resume,
        out_dir / "checkpoints",
        d.rank,
        d.world_size,
        cfg.checkpoint.reshard,
        gather,
        lambda message: warn_damaged_checkpoint(message, warn),
    )
    dataset = load_data(cfg, d, log)
    models, unet_bf16, lora_base, text_lora_base = load_models(cfg, d, dtype, log)
    shared, rank_state = load_resume(resume, cfg, d, out_dir, models, log)
    wrap = functools.partial(wrap_ddp, cfg=cfg, d=d)
    fitted_vae = models.from_scratch and cfg.model.vae_warmup_steps > 0
    if fitted_vae and shared is None:
        fit_new_vae(cfg, d, models.vae, dataset, wrap, log)
    # Aspect-ratio buckets after the VAE fit (which trains on squares), before the cache (keyed by them).
    target_sizes = prepare_buckets(dataset, cfg.data, side_step(models), log)
    scaling = float(models.vae.config.scaling_factor)
    frozen_dtype = cast_frozen(models, dtype, d.device)  # after the VAE fit, which trains in fp32
    sampler, loader = build_loader(cfg, d, models, dataset, frozen_dtype, target_sizes, log)
    opt = build_optimization(cfg, d, models, dtype, unet_bf16, log)
    step = 0
    if shared is not None:
        assert resume is not None
        step = restore_training(
            resume, shared, rank_state, {**opt, "sampler": sampler}, opt["generator"], cfg.train.seed, d.rank,
            (lora_base, text_lora_base),
        )  # fmt: skip
        log(f"resumed from {resume.path} at step {step}")
        sdi.event(EventKind.CHECKPOINT, step=step, path=str(resume.path), action="resume")
    guard_state = (shared or {}).get("oom_guard")
    guarded = build_ddp(cfg, d, opt, wrap, guard_state, log, warn)
    objective = build_objective(cfg, models, d.device, dtype, frozen_dtype, opt, unet_bf16)
    offloaded = offload_frozen(cfg, d, models)
    run = Run(
        cfg=cfg,
        dist=d,
        out_dir=out_dir,
        start_time=start_time,
        dtype=dtype,
        frozen_dtype=frozen_dtype,
        models=models,
        sampler=sampler,
        loader=loader,
        optimizer=opt["optimizer"],
        lr_scheduler=opt["lr_scheduler"],
        ema=opt["ema"],
        scaler=opt["scaler"],
        generator=opt["generator"],
        objective=objective,
        fitted_vae=fitted_vae,
        scaling=scaling,
        offloaded=offloaded,
        lora_base=lora_base,
        text_lora_base=text_lora_base,
        step=step,
    )
    run.train_step = build_train_step(run, opt["params"], guarded, guard_state, log)
    return run


def build_train_step(
    run: Run, params: list[torch.nn.Parameter], guarded: dict[str, Any], guard_state: Any, log: Log
) -> TrainStep:
    """The loop's step: `guarded` (build_ddp's pieces), the optimizer step and the non-finite watch."""
    cfg, d = run.cfg, run.dist
    optimizer_step = OptimizerStep(
        run.optimizer,
        run.lr_scheduler,
        params,
        cfg.train.max_grad_norm,
        run.scaler,
        run.ema,
        NonFiniteWatch(d.device, d.rank, d.world_size),
        lambda: run.step + 1,  # the loop's step at the time of the call
    )
    return TrainStep(
        **guarded,
        forward_backward=run.objective.forward_backward,
        optimizer_step=optimizer_step,
        advice=functools.partial(divergence_advice, cfg, run.ckpt_root),
        log=log,
        saved_guard_state=guard_state,
    )


def fit_new_vae(
    cfg: Config, d: Dist, vae: AutoencoderKL, dataset: Any, wrap: Callable[[torch.nn.Module], Any], log: Log
) -> None:
    """Fit a VAE built from scratch on the training images (data-parallel; trainer/vae_fit.py)."""
    fit_vae(
        vae,
        dataset,
        steps=cfg.model.vae_warmup_steps,
        batch_size=cfg.model.vae_warmup_batch,
        lr=cfg.model.vae_warmup_lr,
        kl_weight=cfg.model.vae_kl_weight,
        device=d.device,
        wrap=wrap,
        rank=d.rank,
        world_size=d.world_size,
        seed=cfg.train.seed,
        log=log,
    )


def resolve_precision(mode: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: bf16 on a CUDA GPU that has it (auto), fp32 on a CPU (auto)."""
    if mode == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]


def warn_damaged_checkpoint(message: str, warn: Log) -> None:
    """One line on rank 0 and a `warning` event on every rank."""
    warn(message)
    sdi.event(EventKind.WARNING, code="checkpoint_damaged", message=message)


def load_data(cfg: Config, d: Dist, log: Log) -> Any:
    """The dataset, checked to give every rank at least one step's images per epoch."""
    dataset = build_dataset(cfg.data, seed=cfg.train.seed, verbose=d.rank == 0)
    if dataset.skipped:
        sdi.event(EventKind.WARNING, code="skipped_images", message=f"{len(dataset.skipped)} images skipped")
    log(f"data {cfg.data.source}: {len(dataset)} images at {cfg.data.resolution} px")
    batch_per_step = cfg.train.micro_batch * cfg.train.grad_accum
    if len(dataset) // d.world_size < batch_per_step:  # the sampler drops the remainder of the split
        raise BadInput(
            f"each rank gets {len(dataset) // d.world_size} images per epoch ({len(dataset)} over "
            f"{d.world_size} ranks), fewer than one step's {batch_per_step} (train.micro_batch x "
            "train.grad_accum); lower train.micro_batch or add data"
        )
    return dataset


def load_models(
    cfg: Config, d: Dist, dtype: torch.dtype, log: Log
) -> tuple[Models, bool, str | None, str | None]:
    """The models on the device, the UNet in its training layout (with LoRA adapters when lora.rank > 0,
    on the text encoder too with lora.text_encoder): (models, whether the UNet is bf16, the LoRA
    bases' fingerprints: the UNet's and the text encoder's, None where that model has no adapters)."""
    device = d.device
    # Model init must be identical on every rank (the frozen parts are never broadcast).
    torch.manual_seed(cfg.train.seed)
    # Random init straight on the GPU (seconds, not a minute of host init for SD-size models);
    # the seeded CUDA generator gives every rank the same weights.
    on_device = cfg.model.init_on_device and not cfg.model.path and device.type == "cuda"
    with torch.device(device) if on_device else contextlib.nullcontext():
        models = build_models(cfg.model.preset, cfg.model.path, cfg.model.prediction_type)
    if on_device:  # the noise schedule's tables belong on the host, as after a normal build
        models.noise_scheduler = type(models.noise_scheduler).from_config(models.noise_scheduler.config)
    unet, vae, text_encoder = models.unet, models.vae, models.text_encoder
    check_model_fits(models, cfg.data.resolution, cfg.sample.steps)
    lora_base = add_lora(unet, cfg.lora)  # None: the whole UNet trains
    text_lora_base = add_text_encoder_lora(text_encoder, cfg.lora)  # frozen; None: without adapters
    if cfg.data.buckets:
        check_bucket_settings(cfg.data, side_step(models))
    log(
        f"model {models.source}: unet {count_parameters(unet):,} | vae {count_parameters(vae):,} | "
        f"text encoder {count_parameters(text_encoder):,} params | {d.world_size} rank(s), {d.backend}, "
        f"{device.type}, {str(dtype).removeprefix('torch.')}"
    )
    if lora_base is not None:
        log(describe_lora(unet, cfg.lora, text_encoder))
    unet.to(device)
    # bf16 weights: no per-forward weight casts and no fp32 GroupNorm round trips under
    # autocast; the optimizer keeps the fp32 master copy (trainer/memory.py).
    unet_bf16 = unet_weights_bf16(cfg.model.unet_dtype, cfg.optim.name, dtype, device)
    if unet_bf16:
        unet.to(dtype=torch.bfloat16)
    vae.to(device).requires_grad_(False).eval()
    # Eval mode also with adapters: CLIP has no dropout of its own; the adapters' dropout follows
    # the train/eval switch of the module that the step calls (build_optimization).
    text_encoder.to(device).eval()
    if cfg.model.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.model.channels_last:
        unet.to(memory_format=torch.channels_last)
        if cfg.model.keep_channels_last:
            keep_channels_last(unet)
    return models, unet_bf16, lora_base, text_lora_base


def cast_frozen(models: Models, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The VAE and the text encoder in the step's dtype on a GPU (fp32 on a CPU), the text encoder's
    LoRA adapters kept in fp32 for the optimizer; returns that dtype of the frozen weights."""
    frozen_dtype = dtype if device.type == "cuda" else torch.float32
    if frozen_dtype != torch.float32:
        models.vae.to(dtype=frozen_dtype)
        models.text_encoder.to(dtype=frozen_dtype)
        keep_adapters_fp32(models.text_encoder)
    return frozen_dtype


def load_resume(
    resume: Resume | None, cfg: Config, d: Dist, out_dir: Path, models: Models, log: Log
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The checkpoint's (shared, this rank's) states, the fitted VAE and text encoder restored from it."""
    if resume is None:
        if cfg.checkpoint.resume == "latest":
            log(f"no checkpoint under {out_dir / 'checkpoints'}: starting from scratch")
        return None, None
    shared, rank_state, _ = load_checkpoint(resume, d.rank)
    if not resume.per_rank:
        log(
            f"re-sharding {resume.path} (saved by {resume.world_size} ranks) onto {d.world_size}: weights, "
            "optimizer and data position resume, the random streams restart (checkpoint.reshard)"
        )
    restore_frozen(models, shared, resume.path)
    return shared, rank_state


def wrap_ddp(module: torch.nn.Module, cfg: Config, d: Dist) -> torch.nn.Module:
    """The DDP wrapper (a factory, so the OOM guard can build a fresh one after a failure)."""
    if d.world_size == 1:
        return module
    return torch.nn.parallel.DistributedDataParallel(
        module,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        bucket_cap_mb=cfg.ddp.bucket_cap_mb,
        find_unused_parameters=cfg.ddp.find_unused_parameters,
        gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
        static_graph=cfg.ddp.static_graph,
    )


def build_loader(
    cfg: Config, d: Dist, models: Models, dataset: Any, frozen_dtype: torch.dtype, target_sizes: Any, log: Log
) -> tuple[Any, Any]:
    """The latent cache (data.cache: encoded once by the frozen models), the sampler and the loader
    (with aspect-ratio buckets: each step's batch from one bucket, the same on every rank)."""
    if cfg.data.cache:
        dataset = build_cache(
            dataset,
            models.vae,
            # The base encoder (sharing its weights): the cache is keyed by, and holds, what the
            # frozen model gives, whatever its adapters have learnt.
            plain_text_encoder(models.text_encoder, merge=False),
            models.tokenizer,
            cfg.data,
            device=d.device,
            rank=d.rank,
            world_size=d.world_size,
            dtype=frozen_dtype,
            batch_size=max(cfg.train.micro_batch, 16),
        )
        log(f"latent cache {'hit' if dataset.stats.hit else 'built'}: {dataset.stats.path}")
    if target_sizes is not None:
        return build_bucket_loader(
            dataset,
            target_sizes,
            cfg.train.micro_batch * cfg.train.grad_accum,
            d.world_size,
            d.rank,
            cfg.train.seed,
            num_workers=cfg.data.num_workers,
            pin_memory=d.device.type == "cuda",
        )
    sampler = ResumableDistributedSampler(dataset, d.world_size, d.rank, shuffle=True, seed=cfg.train.seed)
    loader = build_dataloader(
        dataset,
        sampler,
        cfg.train.micro_batch * cfg.train.grad_accum,
        num_workers=cfg.data.num_workers,
        pin_memory=d.device.type == "cuda",
        seed=cfg.train.seed,
    )
    return sampler, loader


def build_optimization(
    cfg: Config, d: Dist, models: Models, dtype: torch.dtype, unet_bf16: bool, log: Log
) -> dict[str, Any]:
    """The model the step calls (`build_trained_module`), the optimizer, LR schedule, EMA, loss
    scaler and this rank's generator, by name."""
    device = d.device
    model, groups = build_trained_module(cfg, models, device, unet_bf16, log)
    params = [p for group in groups for p in group["params"]]
    optimizer = build_training_optimizer(groups, cfg.optim, device, unet_bf16)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    ema_dtype = torch.bfloat16 if cfg.train.ema_dtype == "bf16" else torch.float32
    ema = EMA(models.unet, cfg.train.ema_decay, dtype=ema_dtype) if cfg.train.ema_decay > 0 else None
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + d.rank)
    return {
        "unet": models.unet,
        "text_encoder": models.text_encoder,
        "model": model,
        "params": params,
        "optimizer": optimizer,
        "lr_scheduler": lr_scheduler,
        "ema": ema,
        "scaler": scaler,
        "generator": generator,
    }


def build_trained_module(
    cfg: Config, models: Models, device: torch.device, unet_bf16: bool, log: Log
) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    """The module the step calls, in training mode, and the optimizer's parameter groups: the UNet
    (compiled, limited to one attention kernel, casting its inputs to bf16, as configured), behind
    the text encoder (`TextConditioned`, a group with lora.text_encoder_lr) when its adapters train."""
    unet = models.unet
    unet.train()
    compile_unet = cfg.model.compile == "true" or (cfg.model.compile == "auto" and device.type == "cuda")
    model: torch.nn.Module = unet
    if compile_unet:
        log(
            f"compiling the UNet{' and the text encoder' if text_encoder_trains(cfg.lora) else ''} with "
            "torch.compile: the first steps take a few minutes"
        )
        separate_compile_cache(cfg.model.attention_backend)
        how = compile_arguments(cfg.model.compile_backend, cfg.model.compile_mode, cfg.model.compile_options)
        model = torch.compile(unet, backend=cfg.model.compile_backend, **how)  # type: ignore[assignment]
    if cfg.model.attention_backend != "auto" and device.type == "cuda":
        model = OnlyAttentionKernel(model, cfg.model.attention_backend)
    if unet_bf16:
        model = CastInputs(model, torch.bfloat16)
    groups: list[dict[str, Any]] = [{"params": [p for p in unet.parameters() if p.requires_grad]}]
    if text_encoder_trains(cfg.lora):
        encoder: torch.nn.Module = models.text_encoder.train()
        if compile_unet:  # eager, its peft layers' launches would cost more host time than its kernels
            encoder = torch.compile(encoder, backend=cfg.model.compile_backend, **how)  # type: ignore[assignment]
        model = TextConditioned(model, encoder)
        text_params = [p for p in models.text_encoder.parameters() if p.requires_grad]
        groups.append({"params": text_params, "lr": cfg.lora.text_encoder_lr or cfg.optim.lr})
    return model, groups


def build_objective(
    cfg: Config,
    models: Models,
    device: torch.device,
    dtype: torch.dtype,
    frozen_dtype: torch.dtype,
    opt: dict[str, Any],
    unet_bf16: bool,
) -> DiffusionObjective:
    """The loss of a step, with `opt`'s generator and loss scaler (build_optimization)."""
    objective = DiffusionObjective(cfg, models, device, dtype, frozen_dtype, opt["generator"], opt["scaler"])
    if unet_bf16:
        objective.autocast = contextlib.nullcontext  # the UNet is bf16 already
    return objective


def build_ddp(
    cfg: Config,
    d: Dist,
    opt: dict[str, Any],
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    guard_state: dict[str, Any] | None,
    log: Log,
    warn: Log,
) -> dict[str, Any]:
    """DDP under the OOM guard (which builds the wrapper), or plain DDP without it: TrainStep's
    guard, ddp_model, micro_batch, grad_accum and guard_turned_on_checkpointing.

    The micro-batch an earlier run fell back to, and gradient checkpointing its guard turned on,
    come back from the checkpoint's `oom_guard` state.
    """
    unet = opt["unet"]
    # Gradient checkpointing that an earlier run's guard turned on stays on after a resume.
    turned_on = bool(
        guard_state and guard_state.get("gradient_checkpointing") and not cfg.model.gradient_checkpointing
    )
    if turned_on:
        unet.enable_gradient_checkpointing()
        log("gradient checkpointing on: the OOM guard had turned it on before the checkpoint")
    extra_state = [opt["lr_scheduler"], opt["scaler"], opt["ema"]]
    guard = build_guard(
        cfg, d.world_size, warn, opt["model"], unet, wrap, opt["optimizer"], extra_state, turned_on
    )
    micro_batch, grad_accum = cfg.train.micro_batch, cfg.train.grad_accum
    batch_per_step = micro_batch * grad_accum
    ddp_model = None
    if guard is not None:
        if guard_state:
            guard.load_state_dict({**guard_state, "gradient_checkpointing": False})
        micro_batch, grad_accum = guard.micro_batch, guard.grad_accum
    else:
        if guard_state and batch_per_step % int(guard_state["micro_batch"]) == 0:
            micro_batch = min(micro_batch, int(guard_state["micro_batch"]))
            grad_accum = batch_per_step // micro_batch
        ddp_model = wrap(opt["model"])
    if (micro_batch, grad_accum) != (cfg.train.micro_batch, cfg.train.grad_accum):
        log(
            f"micro-batch {micro_batch} x {grad_accum} accumulation, from the checkpoint "
            f"(configured {cfg.train.micro_batch} x {cfg.train.grad_accum}, the OOM guard fell back)"
        )
    return {
        "guard": guard,
        "ddp_model": ddp_model,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "guard_turned_on_checkpointing": turned_on,
    }


def build_guard(
    cfg: Config,
    world_size: int,
    warn: Log,
    model: torch.nn.Module,
    unet: UNet2DConditionModel,
    wrap: Any,
    optimizer: torch.optim.Optimizer,
    extra_state: list[Any],
    checkpointing_on: bool,
) -> OOMGuard | None:
    """The OOM guard (it builds the DDP wrapper), or None when train.oom_guard is off or cannot apply."""
    if not cfg.train.oom_guard:
        return None
    if cfg.ddp.find_unused_parameters and world_size > 1:
        message = (
            "OOM guard off: it does not support ddp.find_unused_parameters=true (a failed rank cannot "
            "complete DDP's extra all-reduce); an out-of-memory will stop the run. Set "
            "ddp.find_unused_parameters=false (SD's UNet uses every parameter) to keep the guard"
        )
        warn(message)
        sdi.event(EventKind.WARNING, code="oom_guard_off", message=message)
        return None
    fallback_checkpointing = (
        cfg.train.oom_fallback_checkpointing and not cfg.model.gradient_checkpointing and not checkpointing_on
    )
    # `model` may be compiled or wrapped to cast inputs to bf16: checkpointing is the UNet's own switch.
    return OOMGuard(
        model,
        wrap=wrap,
        optimizer=optimizer,
        micro_batch=cfg.train.micro_batch,
        grad_accum=cfg.train.grad_accum,
        enable_gradient_checkpointing=unet.enable_gradient_checkpointing if fallback_checkpointing else None,
        # Restored with the optimizer when a step is rolled back or copied from a healthy rank.
        extra_state=[obj for obj in extra_state if obj is not None],
    )


def divergence_advice(cfg: Config, ckpt_root: Path) -> str:
    """What to try after a divergence: the newest checkpoint (from before it) with a lower LR."""
    lower = f"a lower optim.lr (now {cfg.optim.lr:g})" + (
        "" if cfg.train.max_grad_norm > 0 else " and train.max_grad_norm=1"
    )
    latest = find_latest(ckpt_root)
    start = (
        f"Resume the newest checkpoint ({latest}, from before it) with --resume latest and {lower}"
        if latest is not None
        else f"No checkpoint was saved before it: start again with {lower}"
    )
    return f"{start}, or look for bad data in the steps before"


def offload_frozen(cfg: Config, d: Dist, models: Models) -> bool:
    """Cached batches never touch the VAE or the text encoder: give their memory to training."""
    offloaded = cfg.model.offload_frozen and cfg.data.cache and d.device.type == "cuda"
    if offloaded:
        models.vae.to("cpu")
        if not text_encoder_trains(cfg.lora):  # adapters that train stay with the UNet
            models.text_encoder.to("cpu")
        torch.cuda.empty_cache()
    return offloaded
