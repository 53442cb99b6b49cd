"""The training loop, top to bottom.

    torchrun --nproc-per-node 2 -m trainer                       # tiny preset on built-in digits
    python -m trainer --preset sd2-base --set train.micro_batch=8   # one process, no torchrun

Order of events: parse config -> process group -> telemetry -> models -> data -> (VAE fit for a
model built from scratch) -> (latent cache) -> DDP -> optimizer -> (resume) -> loop -> export.
Each optimizer step goes through sddoctor's OOM guard (`train.oom_guard`, on by default): an
out-of-memory on any rank lowers the micro-batch on every rank, raises accumulation to keep the
global batch, and redoes the step; without the guard it is `trainer.step.run_step`. Everything
random in a step is drawn for the whole batch from one generator per rank, which a checkpoint
saves, so a resumed run repeats the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sddoctor.instrument import api as sdi
from sddoctor.instrument.oom_guard import OOMGuard, OOMGuardError
from sddoctor.telemetry.layout import RUN_DIR_ENV, RunDir
from sddoctor.telemetry.schema import EventKind
from trainer.buckets import build_bucket_loader, check_bucket_settings, prepare_buckets
from trainer.cache import build_cache
from trainer.checkpoint import (
    CheckpointError,
    choose_checkpoint,
    find_latest,
    fresh_rng_state,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import Config, ConfigError, build_config, to_dict, to_toml
from trainer.data import DataError, ResumableDistributedSampler, build_dataloader, build_dataset
from trainer.export import export_model
from trainer.lora import add_lora, describe_lora, load_unet_state, unet_state
from trainer.memory import CastInputs, unet_weights_bf16
from trainer.models import (
    ModelLoadError,
    build_models,
    check_model_fits,
    count_parameters,
    set_attention_backend,
    side_step,
)
from trainer.nonfinite import NonFiniteError, NonFiniteWatch
from trainer.objective import DiffusionObjective
from trainer.optim import EMA, build_lr_scheduler, build_training_optimizer, check_optimizer
from trainer.progress import ProgressLine, StepReporter, memory_bytes
from trainer.sample import ema_weights, sample_grid, save_grid
from trainer.step import batch_size, run_step
from trainer.step_profile import StepProfiler, parse_steps
from trainer.vae_fit import fit_vae

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3

HELP_EPILOG = """\
examples:
  torchrun --nproc-per-node 2 -m trainer                      2 ranks, tiny preset, built-in digits
  python -m trainer --preset sd2-base --set data.source=./my-images --set train.micro_batch=8
  torchrun --nproc-per-node 8 -m trainer --config run.toml --set train.max_steps=10000
  python -m trainer --model ./runs/tiny/export --set train.max_steps=50   fine-tune a saved model
  torchrun --nproc-per-node 2 -m trainer --resume latest      continue ./runs/tiny/ after a stop
  python -m trainer --print-config > run.toml                 every key, resolved

configuration: dataclass defaults <- --preset <- --config FILE (TOML, Python 3.11+ or tomli)
  <- --set key.sub=value (repeatable; lists: a;b;c or JSON). An unknown or mistyped key is an
  error naming the valid keys. See docs/trainer.md for every key.

output: ./runs/<output.name or preset>/ unless --output-dir (or $SDDOCTOR_RUN_DIR under
  `sddoctor run`): telemetry (ranks/), checkpoints/, samples/, export/ (a diffusers folder).

exit codes:
  0    finished
  1    training failed (exception; traceback printed, `exception` event written), or out of
       memory even at micro-batch 1 (the OOM guard's message names the memory and what to try)
  2    bad input: unknown preset or config key, a value outside what the key allows, bad
       TOML, missing model or data folder, unusable data, a --resume target that is damaged,
       in the earlier pickle format, or from another number of ranks
  3    training diverged: the loss or gradient became NaN/inf; nothing was saved after it
  130  stopped by SIGINT, 143 by SIGTERM (after saving a checkpoint)
"""


class BadInput(Exception):
    """Wraps the user-input errors of every module; turns into exit code 2."""


BAD_INPUT_ERRORS = (ConfigError, ModelLoadError, DataError, CheckpointError, BadInput)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="DDP Stable Diffusion trainer, instrumented for sddoctor.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", help="tiny (default) | sd15 | sd2-base | sd2 (768-v)")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file of config values ([train] max_steps = 100)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        nargs="+",
        help="override one config key, e.g. --set train.max_steps=100 optim.lr=1e-4",
    )
    parser.add_argument("--model", metavar="PATH", help="local diffusers folder to start from (model.path)")
    parser.add_argument(
        "--resume", metavar="latest|PATH", help="resume from a checkpoint (checkpoint.resume)"
    )
    parser.add_argument("--output-dir", metavar="DIR", help="output directory (output.dir)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as TOML and exit"
    )
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = [item for group in args.overrides for item in group]
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.output_dir:
        overrides.append(f"output.dir={args.output_dir}")
    return build_config(args.preset, args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.print_config:
        print(to_toml(cfg))
        return EXIT_OK
    _quiet_libraries()
    return Trainer(cfg).run()


def _quiet_libraries() -> None:
    """Keep the console to the trainer's lines: library progress bars and info chatter off."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # DDP notes that 1x1 conv gradients have other (equivalent) strides than its buckets: harmless.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")


def preflight_warnings() -> None:
    """`sddoctor check-nccl`'s environment checks (NCCL variables, /dev/shm, limits, GPUs, ...) before
    the process group starts: warn/fail findings are printed and, when a telemetry session is active
    (under `sddoctor run`), recorded as `warning` events. Local rank 0 only, checks only (no
    collective test: it would compete with the job), never raises. SDDOCTOR_PREFLIGHT=0 skips it.
    """
    if os.environ.get("SDDOCTOR_PREFLIGHT", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        from sddoctor.preflight import format_findings, run_preflight

        t0 = time.perf_counter()
        findings = [f for f in run_preflight(quick=True) if f.severity in ("warn", "fail")]
        if not findings:
            return
        print(
            f"preflight: {len(findings)} finding(s) ({time.perf_counter() - t0:.1f}s; "
            "`sddoctor check-nccl` for the full check, SDDOCTOR_PREFLIGHT=0 to skip)",
            file=sys.stderr,
        )
        print(format_findings(findings, min_severity="warn"), file=sys.stderr, flush=True)
        if sdi.active() is not None:
            for f in findings:
                sdi.event(
                    EventKind.WARNING,
                    code=f.id,
                    message=f.title,
                    severity=f.severity,
                    remedy=f.remedy,
                    source="preflight",
                )
    except Exception as exc:  # noqa: BLE001 - a preflight must never stop training
        print(f"preflight: skipped ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)


# -- the process group ----------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def setup_distributed(backend: str, timeout_s: int) -> Dist:
    """Join torchrun's process group, or make a one-rank group when started without torchrun."""
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and "device_id" in dist.init_process_group.__code__.co_varnames:
        kwargs["device_id"] = device  # binds the communicator to this GPU (no guessing at barriers)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    return Dist(rank, local_rank, world_size, device, backend)


def resolve_precision(mode: str, device: torch.device) -> torch.dtype:
    if mode == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]


def output_dir_for(cfg: Config) -> Path:
    if cfg.output.dir:
        return Path(cfg.output.dir)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    return Path("runs") / (cfg.output.name or cfg.model.preset)


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next agreement point.

    A second SIGINT falls through to Python's default (KeyboardInterrupt) for the impatient.
    """

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        self.signum = signum


# -- the trainer -----------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def log(self, message: str) -> None:
        if self.dist.rank == 0:
            print(message, flush=True)

    def warn_damaged_checkpoint(self, message: str) -> None:
        """One line on rank 0 and a `warning` event on every rank."""
        self.log(f"warning: {message}")
        sdi.event(EventKind.WARNING, code="checkpoint_damaged", message=message)

    def run(self) -> int:
        cfg = self.cfg
        preflight_warnings()
        self.dist = setup_distributed(cfg.ddp.backend, cfg.ddp.timeout_s)
        self.out_dir = output_dir_for(cfg)
        telemetry_dir = os.environ.get(RUN_DIR_ENV) or str(self.out_dir)
        sdi.enable(
            telemetry_dir,
            trace=cfg.train.trace_collectives,
            infer_steps=False,  # the trainer reports its own steps
            rank=self.dist.rank,
            local_rank=self.dist.local_rank,
            world_size=self.dist.world_size,
            device=str(self.dist.device),
            backend=self.dist.backend,
            python=sys.version.split()[0],
            torch=torch.__version__,
        )
        if self.dist.rank == 0 and not os.environ.get(RUN_DIR_ENV):
            RunDir(self.out_dir).ensure().write_run_info(
                command=sys.argv,
                world_size=self.dist.world_size,
                backend=self.dist.backend,
                device=self.dist.device.type,
                trainer={"preset": cfg.model.preset, "model": cfg.model.path or None, "config": to_dict(cfg)},
                started=time.time(),
            )
        status, code = "error", EXIT_FAILED
        try:
            code = self.train()
            status = "ok" if code == EXIT_OK else "signal"
        except BAD_INPUT_ERRORS as exc:
            print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
            sdi.event(EventKind.WARNING, code="bad_input", message=str(exc))
            code = EXIT_BAD_INPUT
        except (OOMGuardError, NonFiniteError) as exc:
            # Raised on every rank alike: the message is the diagnosis, a traceback adds nothing.
            if self.dist.rank == 0 or isinstance(exc, OOMGuardError):
                print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
            sdi.event(EventKind.EXCEPTION, type=type(exc).__name__, message=str(exc))
            code = EXIT_DIVERGED if isinstance(exc, NonFiniteError) else EXIT_FAILED
        except Exception as exc:
            tb = traceback.extract_tb(exc.__traceback__)
            sdi.event(
                EventKind.EXCEPTION,
                type=type(exc).__name__,
                message=str(exc),
                traceback=[f"{f.filename}:{f.lineno} in {f.name}" for f in tb],
                caller=f"{tb[-1].filename}:{tb[-1].lineno}" if tb else None,
            )
            traceback.print_exc()
            code = EXIT_FAILED
        finally:
            sdi.disable(status=status, code=code)
            if dist.is_initialized():
                if code in (EXIT_OK, EXIT_DIVERGED, 128 + signal.SIGINT, 128 + signal.SIGTERM):
                    # The DDP model, the OOM guard's hooks and control group and their pending works
                    # form reference cycles that outlive train(); left to the interpreter's final
                    # teardown, a gloo group's worker threads can then release Python objects after
                    # Python is gone (the rank aborts after "done"). Free them while it is alive.
                    gc.collect()
                    dist.destroy_process_group()
                # after a failure other ranks may still sit in a collective: do not wait for them
        return code

    def train(self) -> int:
        cfg, d = self.cfg, self.dist
        device = d.device
        dtype = resolve_precision(cfg.train.mixed_precision, device)
        if dtype == torch.bfloat16 and device.type == "cpu" and cfg.train.mixed_precision == "auto":
            dtype = torch.float32
        start_time = time.time()
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
            torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
            torch.backends.cudnn.allow_tf32 = cfg.train.tf32
            set_attention_backend(cfg.model.attention_backend)
        check_optimizer(cfg.optim, device)

        # Bad input (data folder, --resume target) fails here, before any model is built.
        ckpt_root = self.out_dir / "checkpoints"
        resume = choose_checkpoint(
            cfg.checkpoint.resume,
            ckpt_root,
            d.rank,
            d.world_size,
            cfg.checkpoint.reshard,
            _gather,
            self.warn_damaged_checkpoint,
        )
        dataset = build_dataset(cfg.data, seed=cfg.train.seed, verbose=d.rank == 0)
        if dataset.skipped:
            sdi.event(
                EventKind.WARNING, code="skipped_images", message=f"{len(dataset.skipped)} images skipped"
            )
        self.log(f"data {cfg.data.source}: {len(dataset)} images at {cfg.data.resolution} px")
        batch_per_step = cfg.train.micro_batch * cfg.train.grad_accum
        if len(dataset) // d.world_size < batch_per_step:  # the sampler drops the remainder of the split
            raise BadInput(
                f"each rank gets {len(dataset) // d.world_size} images per epoch ({len(dataset)} over "
                f"{d.world_size} ranks), fewer than one step's {batch_per_step} (train.micro_batch x "
                "train.grad_accum); lower train.micro_batch or add data"
            )

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
        if cfg.data.buckets:
            check_bucket_settings(cfg.data, side_step(models))
        self.log(
            f"model {models.source}: unet {count_parameters(unet):,} | vae {count_parameters(vae):,} | "
            f"text encoder {count_parameters(text_encoder):,} params | {d.world_size} rank(s), {d.backend}, "
            f"{device.type}, {str(dtype).removeprefix('torch.')}"
        )
        if lora_base is not None:
            self.log(describe_lora(unet, cfg.lora))
        unet.to(device)
        # bf16 weights: no per-forward weight casts and no fp32 GroupNorm round trips under
        # autocast; the optimizer keeps the fp32 master copy (trainer/memory.py).
        unet_bf16 = unet_weights_bf16(cfg.model.unet_dtype, cfg.optim.name, dtype, device)
        if unet_bf16:
            unet.to(dtype=torch.bfloat16)
        vae.to(device).requires_grad_(False).eval()
        text_encoder.to(device).requires_grad_(False).eval()
        if cfg.model.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        if cfg.model.channels_last:
            unet.to(memory_format=torch.channels_last)

        shared: dict[str, Any] | None = None
        rank_state: dict[str, Any] | None = None
        if cfg.checkpoint.resume == "latest" and resume is None:
            self.log(f"no checkpoint under {ckpt_root}: starting from scratch")
        if resume is not None:
            shared, rank_state, _ = load_checkpoint(resume, d.rank)
            if not resume.per_rank:
                self.log(
                    f"re-sharding {resume.path} (saved by {resume.world_size} ranks) onto {d.world_size}: weights, "
                    "optimizer and data position resume, the random streams restart (checkpoint.reshard)"
                )
            with _checkpoint_must_fit(resume.path):
                if "vae" in shared:
                    vae.load_state_dict(shared["vae"])
                    vae.register_to_config(scaling_factor=float(shared["vae_scaling_factor"]))
                if "text_encoder" in shared:
                    text_encoder.load_state_dict(shared["text_encoder"])

        def wrap(module: torch.nn.Module) -> torch.nn.Module:
            """The DDP wrapper (a factory, so the OOM guard can build a fresh one after a failure)."""
            if d.world_size == 1:
                return module
            return torch.nn.parallel.DistributedDataParallel(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                find_unused_parameters=cfg.ddp.find_unused_parameters,
                gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
                static_graph=cfg.ddp.static_graph,
            )

        fitted_vae = models.from_scratch and cfg.model.vae_warmup_steps > 0
        if fitted_vae and shared is None:
            fit_vae(
                vae,
                dataset,
                steps=cfg.model.vae_warmup_steps,
                batch_size=cfg.model.vae_warmup_batch,
                lr=cfg.model.vae_warmup_lr,
                kl_weight=cfg.model.vae_kl_weight,
                device=device,
                wrap=wrap,
                rank=d.rank,
                world_size=d.world_size,
                seed=cfg.train.seed,
                log=self.log,
            )
        # Aspect-ratio buckets after the VAE fit (which trains on squares), before the cache (keyed by them).
        target_sizes = prepare_buckets(dataset, cfg.data, side_step(models), self.log)
        scaling = float(vae.config.scaling_factor)
        frozen_dtype = dtype if device.type == "cuda" else torch.float32
        if frozen_dtype != torch.float32:
            vae.to(dtype=frozen_dtype)
            text_encoder.to(dtype=frozen_dtype)
        if cfg.data.cache:
            dataset = build_cache(
                dataset,
                vae,
                text_encoder,
                models.tokenizer,
                cfg.data,
                device=device,
                rank=d.rank,
                world_size=d.world_size,
                dtype=frozen_dtype,
                batch_size=max(cfg.train.micro_batch, 16),
            )
            self.log(f"latent cache {'hit' if dataset.stats.hit else 'built'}: {dataset.stats.path}")
        if target_sizes is not None:  # each step's batch from one bucket, the same on every rank
            sampler, loader = build_bucket_loader(
                dataset,
                target_sizes,
                batch_per_step,
                d.world_size,
                d.rank,
                cfg.train.seed,
                num_workers=cfg.data.num_workers,
                pin_memory=device.type == "cuda",
            )
        else:
            sampler = ResumableDistributedSampler(
                dataset, d.world_size, d.rank, shuffle=True, seed=cfg.train.seed
            )
            loader = build_dataloader(
                dataset,
                sampler,
                batch_per_step,
                num_workers=cfg.data.num_workers,
                pin_memory=device.type == "cuda",
                seed=cfg.train.seed,
            )

        # Optimizer, schedule, EMA, loss scaler; then the DDP wrapper (built by the OOM guard).
        unet.train()
        compile_unet = cfg.model.compile == "true" or (cfg.model.compile == "auto" and device.type == "cuda")
        if compile_unet:
            self.log("compiling the UNet with torch.compile: the first steps take a few minutes")
            model = torch.compile(
                unet, backend=cfg.model.compile_backend, mode=cfg.model.compile_mode or None
            )
        else:
            model = unet
        if unet_bf16:
            model = CastInputs(model, torch.bfloat16)
        params = [p for p in unet.parameters() if p.requires_grad]
        optimizer = build_training_optimizer(params, cfg.optim, device, unet_bf16)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        ema_dtype = torch.bfloat16 if cfg.train.ema_dtype == "bf16" else torch.float32
        ema = EMA(unet, cfg.train.ema_decay, dtype=ema_dtype) if cfg.train.ema_decay > 0 else None
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        generator = torch.Generator(device=device).manual_seed(cfg.train.seed * 1_000_003 + d.rank)
        step = 0
        if shared is not None:
            assert resume is not None
            with _checkpoint_must_fit(resume.path):
                load_unet_state(unet, shared, lora_base)
                optimizer.load_state_dict(shared["optimizer"])
                lr_scheduler.load_state_dict(shared["lr_scheduler"])
                if ema is not None and shared.get("ema") is not None:
                    ema.load_state_dict(shared["ema"])
                if scaler is not None and shared.get("scaler") is not None:
                    scaler.load_state_dict(shared["scaler"])
                step = int(shared["step"])
                sampler.load_state_dict(
                    shared["samplers"][0] if rank_state is None else rank_state["sampler"]
                )
            if rank_state is not None:
                set_rng_state(rank_state["rng"], generator)
            else:
                fresh_rng_state(cfg.train.seed, step, d.rank, generator)
            self.log(f"resumed from {resume.path} at step {step}")
            sdi.event(EventKind.CHECKPOINT, step=step, path=str(resume.path), action="resume")

        guard_state = (shared or {}).get("oom_guard")
        # Gradient checkpointing that an earlier run's guard turned on stays on after a resume.
        guard_turned_on_checkpointing = bool(
            guard_state and guard_state.get("gradient_checkpointing") and not cfg.model.gradient_checkpointing
        )
        if guard_turned_on_checkpointing:
            unet.enable_gradient_checkpointing()
            self.log("gradient checkpointing on: the OOM guard had turned it on before the checkpoint")
        guard = self.build_guard(
            model, unet, wrap, optimizer, [lr_scheduler, scaler, ema], guard_turned_on_checkpointing
        )
        micro_batch, grad_accum = cfg.train.micro_batch, cfg.train.grad_accum
        if guard is not None:
            if guard_state:
                guard.load_state_dict({**guard_state, "gradient_checkpointing": False})
            micro_batch, grad_accum = guard.micro_batch, guard.grad_accum
            # No reference to guard.model here: after a failure the guard replaces the wrapper, and a
            # stale reference would keep the old one's gradient buckets in memory.
            ddp_model = None
        else:
            if guard_state and batch_per_step % int(guard_state["micro_batch"]) == 0:
                micro_batch = min(micro_batch, int(guard_state["micro_batch"]))
                grad_accum = batch_per_step // micro_batch
            ddp_model = wrap(model)
        if (micro_batch, grad_accum) != (cfg.train.micro_batch, cfg.train.grad_accum):
            self.log(
                f"micro-batch {micro_batch} x {grad_accum} accumulation, from the checkpoint "
                f"(configured {cfg.train.micro_batch} x {cfg.train.grad_accum}, the OOM guard fell back)"
            )

        def guard_checkpoint_state() -> dict[str, Any] | None:
            if guard is None:
                return guard_state  # keep what an earlier guarded run learnt
            state = guard.state_dict()
            state["gradient_checkpointing"] = guard.gradient_checkpointing or guard_turned_on_checkpointing
            return state

        def settle() -> None:
            """Finish the OOM guard's agreement on the last optimizer step (every rank) before reading the model."""
            if guard is not None and guard.settle():
                self.log_fallback(guard, step)

        objective = DiffusionObjective(cfg, models, device, dtype, frozen_dtype, generator, scaler)
        if unet_bf16:
            objective.autocast = contextlib.nullcontext  # the UNet is bf16 already
        # Cached batches never touch the VAE or the text encoder: give their memory to training.
        offloaded = cfg.model.offload_frozen and cfg.data.cache and device.type == "cuda"
        if offloaded:
            vae.to("cpu")
            text_encoder.to("cpu")
            torch.cuda.empty_cache()

        # The learning rate the latest optimizer step used. Read here rather than before the step:
        # when the OOM guard repairs a rank's failed optimizer step at the next step's agreement, it
        # copies the scheduler from a healthy rank first, and the step then runs at that rate.
        used_lr = [lr_scheduler.get_last_lr()[0]]
        watch = NonFiniteWatch(device, d.rank, d.world_size)

        def check_finite(reduced: list[float] | None = None) -> None:
            """Every rank: stop (NonFiniteError, exit 3) if a loss or gradient was NaN/inf since the start.

            `reduced`: the watch's numbers already MAX-reduced with the stop flag (no collective here).
            """
            watch.check(reduced, "training", divergence_advice)

        def divergence_advice() -> str:
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

        def optimizer_step() -> None:
            """Unscale, clip, step, schedule, EMA, zero_grad."""
            sdi.phase("optimizer")
            used_lr[0] = optimizer.param_groups[0]["lr"]
            if scaler is not None:
                scaler.unscale_(optimizer)
            if cfg.train.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm, foreach=True)
            else:
                grad_norm = gradient_norm(params)
            if scaler is None:  # the fp16 loss scaler skips steps with overflowing gradients itself
                watch.observe(step + 1, grad_norm=grad_norm)
            if scaler is not None:
                try:
                    scaler.step(optimizer)
                except Exception:
                    # update() did not run, so the scaler still marks this optimizer as unscaled and
                    # would refuse the unscale_() of the step the OOM guard redoes or repairs.
                    scaler._per_optimizer_states.clear()
                    raise
                scaler.update()
            else:
                optimizer.step()
            lr_scheduler.step()
            if ema is not None:
                ema.update()
            optimizer.zero_grad(set_to_none=True)

        def shared_state() -> dict[str, Any]:
            state = {
                "step": step,
                **unet_state(unet, lora_base),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "ema": ema.state_dict() if ema is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "samplers": [sampler.state_dict()],
                "config": to_dict(cfg),
                "oom_guard": guard_checkpoint_state(),
            }
            if fitted_vae:
                state["vae"] = vae.state_dict()
                state["vae_scaling_factor"] = scaling
            if models.from_scratch:
                state["text_encoder"] = text_encoder.state_dict()
            return state

        def save(reason: str) -> None:
            settle()
            check_finite()
            t0 = time.time()
            path = save_checkpoint(
                ckpt_root,
                step,
                shared_state,
                {"rng": rng_state(generator), "sampler": sampler.state_dict(), "step": step},
                d.rank,
                d.world_size,
                _barrier,
                keep=cfg.checkpoint.keep,
            )
            seconds = time.time() - t0
            sdi.event(EventKind.CHECKPOINT, step=step, path=str(path), seconds=seconds, reason=reason)
            self.log(f"checkpoint {path} ({reason}, {seconds:.1f}s)")

        def samples() -> None:
            if not cfg.sample.prompts:
                return
            settle()
            check_finite()
            if d.rank == 0:
                t0 = time.time()
                if offloaded:
                    vae.to(device)
                    text_encoder.to(device)
                with ema_weights(unet, ema):
                    grid = sample_grid(
                        models,
                        unet,
                        cfg.sample.prompts,
                        cfg.sample.images_per_prompt,
                        cfg.sample.steps,
                        cfg.sample.guidance_scale,
                        cfg.data.resolution,
                        cfg.sample.seed,
                        device,
                        dtype,
                    )
                if offloaded:
                    vae.to("cpu")
                    text_encoder.to("cpu")
                path = save_grid(grid, self.out_dir / "samples", step)
                self.log(f"samples {path} ({time.time() - t0:.1f}s)")
            _barrier()

        # -- the loop ----------------------------------------------------------------------
        stop = StopRequested()
        if cfg.checkpoint.on_signal:
            stop.install()
        images_per_step = batch_per_step * d.world_size
        reporter = StepReporter(device)
        progress = ProgressLine(cfg.train.max_steps, d.world_size, device)
        progress.reset(step)
        loss_window = torch.zeros((), device=device)
        window_steps = 0
        if device.type == "cuda":  # step events report the training peak, not the setup's (cache build)
            torch.cuda.reset_peak_memory_stats(device)
        mem_alloc, mem_peak = memory_bytes(device)
        self.log(
            f"training {cfg.train.max_steps} steps from step {step}: global batch {images_per_step} "
            f"= {micro_batch} micro x {grad_accum} accum x {d.world_size} ranks "
            f"| OOM guard {'on' if guard is not None else 'off'} "
            f"| output {self.out_dir} | setup {time.time() - start_time:.1f}s"
        )
        first_loss: float | None = None
        profiler = StepProfiler(
            parse_steps(cfg.train.profile_steps), self.out_dir / "profile", d.rank, device
        )
        epoch = sampler.epoch
        data_iter = None
        last_end = time.perf_counter()
        while step < cfg.train.max_steps:
            sdi.phase("data")
            wait_start = time.perf_counter()
            if data_iter is None:
                sampler.set_epoch(epoch)
                data_iter = iter(loader)
            with profiler.range("trainer: data"):
                try:
                    raw = next(data_iter)
                except StopIteration:
                    epoch += 1
                    data_iter = None
                    continue
                batch = objective.prepare(raw)
            data_wait = time.perf_counter() - wait_start  # host time waiting for the loader
            samples_in_step = batch_size(batch)
            profiler.before_step(step + 1)
            with profiler.range("trainer: step"):
                if guard is not None:
                    # Numbered as its step event will be (1-based), as SDDOCTOR_FAULT's step= counts.
                    result = guard.run_step(batch, objective.forward_backward, optimizer_step, step + 1)
                    if result.fell_back:
                        self.log_fallback(guard, step + 1)
                else:
                    result = run_step(
                        ddp_model, batch, micro_batch, grad_accum, objective.forward_backward, optimizer_step
                    )
            del batch
            sampler.advance(samples_in_step)
            lr = used_lr[0]
            step += 1
            watch.observe(step, loss=result.loss)
            now = time.perf_counter()
            step_time, last_end = now - last_end, now
            loss_window += result.loss
            window_steps += 1
            mem_alloc, mem_peak = memory_bytes(device)
            if written := profiler.after_step(step):
                self.log(f"profile of steps {cfg.train.profile_steps}: {written}")
            reporter.push(
                step,
                result.loss,
                samples=samples_in_step,
                step_time=step_time,
                micro_batch=result.micro_batch,
                grad_accum=result.grad_accum,
                mem_alloc=mem_alloc,
                mem_peak=mem_peak,
                lr=lr,
                images_per_s=images_per_step / step_time if step_time > 0 else None,
                data_wait=data_wait,
                t_end=time.time(),  # on CUDA the event itself is written once the GPU is done
            )

            # Logging interval: the one host sync (mean loss over ranks, and whether anyone was signalled).
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                reporter.flush()
                mean = loss_window / window_steps
                # The stop flag and the non-finite watch share one all-reduce (MAX).
                flag = torch.cat([torch.full((1,), float(stop.signum), device=device), watch.for_max()])
                dist.all_reduce(mean)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                mean_loss = mean.item() / d.world_size
                flags = flag.tolist()
                signalled = int(flags[0])
                check_finite(flags[1:])
                first_loss = mean_loss if first_loss is None else first_loss
                if d.rank == 0:
                    progress.show(step, mean_loss, images_per_step, lr)
                loss_window.zero_()
                window_steps = 0
                if signalled:
                    if stop.signum == 0:
                        stop.signum = signalled
                    save(f"signal {signal.Signals(signalled).name}")
                    return 128 + signalled
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.max_steps:
                save("periodic")
            if cfg.sample.every and step % cfg.sample.every == 0 and step < cfg.train.max_steps:
                samples()
            last_end = time.perf_counter()  # step_time covers data + step, not logging or saving

        reporter.flush()
        settle()
        self.check_replicas(unet, step)
        if cfg.checkpoint.at_end:
            save("end")
        if cfg.sample.at_end:
            samples()
        if cfg.output.export:
            settle()
            check_finite()
            if d.rank == 0:
                name = cfg.output.name or cfg.model.preset
                lora = cfg.lora if lora_base else None
                path = export_model(models, unet, self.out_dir / "export", ema, single_file=name, lora=lora)
                self.log(f"exported diffusers folder {path}")
            _barrier()
        self.log(f"done: {step} steps in {time.time() - start_time:.1f}s")
        return EXIT_OK

    def build_guard(
        self,
        model: torch.nn.Module,
        unet: torch.nn.Module,
        wrap: Any,
        optimizer: torch.optim.Optimizer,
        extra_state: list[Any],
        checkpointing_on: bool,
    ) -> OOMGuard | None:
        """The OOM guard (it builds the DDP wrapper), or None when train.oom_guard is off or cannot apply."""
        cfg = self.cfg
        if not cfg.train.oom_guard:
            return None
        if cfg.ddp.find_unused_parameters and self.dist.world_size > 1:
            message = (
                "OOM guard off: it does not support ddp.find_unused_parameters=true (a failed rank cannot "
                "complete DDP's extra all-reduce); an out-of-memory will stop the run. Set "
                "ddp.find_unused_parameters=false (SD's UNet uses every parameter) to keep the guard"
            )
            self.log(f"warning: {message}")
            sdi.event(EventKind.WARNING, code="oom_guard_off", message=message)
            return None
        fallback_checkpointing = (
            cfg.train.oom_fallback_checkpointing
            and not cfg.model.gradient_checkpointing
            and not checkpointing_on
        )
        # `model` may be compiled or wrapped to cast inputs to bf16: checkpointing is the UNet's own switch.
        return OOMGuard(
            model,
            wrap=wrap,
            optimizer=optimizer,
            micro_batch=cfg.train.micro_batch,
            grad_accum=cfg.train.grad_accum,
            enable_gradient_checkpointing=unet.enable_gradient_checkpointing
            if fallback_checkpointing
            else None,
            # Restored with the optimizer when a step is rolled back or copied from a healthy rank.
            extra_state=[obj for obj in extra_state if obj is not None],
        )

    def log_fallback(self, guard: OOMGuard, step: int) -> None:
        """One rank-0 line per fallback; the `oom`/`fallback` events carry the details."""
        last = guard.last_fallback or {}
        checkpointing = ", gradient checkpointing on" if guard.gradient_checkpointing else ""
        self.log(
            f"OOM guard: {last.get('reason', 'out of memory')} at step {last.get('step', step)}: every rank now "
            f"runs micro-batch {guard.micro_batch} x {guard.grad_accum} accumulation{checkpointing} "
            f"(was {last.get('old_micro_batch', '?')} x {last.get('old_grad_accum', '?')}; same global batch); "
            + (
                "the failed optimizer step was completed from a healthy rank"
                if last.get("step_applied")
                else "the step was redone"
            )
        )

    def check_replicas(self, unet: torch.nn.Module, step: int) -> None:
        """Compare a digest of the UNet weights across ranks: DDP must keep them identical."""
        digest = params_digest(unet)
        sdi.event("replicas", step=step, params_sha256=digest)
        digests: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            message = f"UNet weights differ across ranks after step {step}: {digests}"
            sdi.event(EventKind.WARNING, code="replicas_differ", message=message)
            self.log(f"warning: {message}")


def params_digest(module: torch.nn.Module) -> str:
    """sha256 over per-tensor float64 sums and position-weighted sums, computed on the device.

    Two ranks whose weights differ anywhere get different digests (short of a crafted
    coincidence); only 2 numbers per tensor leave the GPU, so it costs milliseconds for SD.
    """
    sums = []
    for p in module.parameters():
        flat = p.detach().reshape(-1).double()
        ramp = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
        sums.append(torch.stack([flat.sum(), (flat * ramp).sum()]))
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()


def gradient_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients, on the device (what clip_grad_norm_ computes, without clipping)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    return torch.linalg.vector_norm(torch.stack([g.float() for g in torch._foreach_norm(grads)]))


@contextlib.contextmanager
def _checkpoint_must_fit(path: Path) -> Any:
    """A checkpoint of another model or configuration is bad input (exit 2), not a crash."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or "no detail"
        raise CheckpointError(
            f"checkpoint {path} does not fit this run ({type(exc).__name__}: {detail[:300]}); resume it "
            "with the preset, model and optimizer settings it was saved with"
        ) from None


def _gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (a collective); [obj] in a one-rank run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _barrier() -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
