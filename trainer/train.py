"""The trainer's command line and its training loop, top to bottom.

    torchrun --nproc-per-node 2 -m trainer                       # tiny preset on built-in digits
    python -m trainer --preset sd2-base --set train.micro_batch=8   # one process, no torchrun

Order of events: parse config -> process group -> telemetry -> `build_run` (trainer/build.py:
data, models, VAE fit, latent cache, optimizer, resume, DDP under the OOM guard) -> the loop ->
the end (replica check, checkpoint, samples, export). The loop delegates: batches to
`trainer.feed.Batches`, the optimizer step (through sddoctor's OOM guard, `train.oom_guard`) to
`trainer.step.TrainStep`, reports (telemetry, progress bar or lines, TensorBoard/wandb) to
`trainer.progress.TrainingLog`, checkpoints to `trainer.checkpointer.Checkpointer`, sample grids
to `trainer.sample.SampleGrids`, profiling to `trainer.step_profile.StepProfiler`. Its one host
sync per logging interval (the mean loss, and the stop flag with the non-finite watch) is
`Trainer.logging_interval`. Everything random in a step is drawn for the whole batch from one
generator per rank, which a checkpoint saves, so a resumed run repeats the uninterrupted one
exactly on CPU.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sddoctor.instrument import api as sdi
from sddoctor.instrument.oom_guard import OOMGuard, OOMGuardError
from sddoctor.telemetry.layout import RUN_DIR_ENV, RunDir
from sddoctor.telemetry.schema import EventKind
from trainer.build import BadInput, Run, build_guard, build_run
from trainer.checkpoint import CheckpointError
from trainer.checkpointer import Checkpointer
from trainer.config import Config, ConfigError, build_config, to_dict, to_toml
from trainer.data import DataError
from trainer.export import export_model
from trainer.feed import Batches
from trainer.models import ModelLoadError
from trainer.nonfinite import NonFiniteError
from trainer.process import Dist, StopRequested, barrier, setup_distributed
from trainer.progress import Progress, TrainingLog
from trainer.sample import SampleGrids
from trainer.step import batch_size
from trainer.step_profile import StepProfiler, parse_steps
from trainer.tracking import TrackerUnavailable, check_available, open_tracker

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
  `sddoctor run`): telemetry (ranks/), checkpoints/, samples/, export/ (a diffusers folder),
  tensorboard/ (`tensorboard --logdir runs/tiny/tensorboard`; --report-to wandb|all|none).
  Rank 0 shows a live progress bar on a terminal and a line per logging interval otherwise
  (output.progress=auto|bar|lines|quiet; --quiet: warnings and errors only).

exit codes:
  0    finished
  1    training failed (exception; traceback printed, `exception` event written), or out of
       memory even at micro-batch 1 (the OOM guard's message names the memory and what to try)
  2    bad input: unknown preset or config key, a value outside what the key allows, bad
       TOML, missing model or data folder, unusable data, a --resume target that is damaged,
       in the earlier pickle format, or from another number of ranks, a --report-to whose
       package is not installed
  3    training diverged: the loss or gradient became NaN/inf; nothing was saved after it
  130  stopped by SIGINT, 143 by SIGTERM (after saving a checkpoint)
"""


BAD_INPUT_ERRORS = (ConfigError, ModelLoadError, DataError, CheckpointError, TrackerUnavailable, BadInput)


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
        "--report-to",
        metavar="tensorboard|wandb|all|none",
        help="where rank 0 writes loss, lr, throughput, memory and sample grids (output.report_to; "
        "default tensorboard, in OUTPUT_DIR/tensorboard/)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress and no information lines: warnings and errors only"
    )
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
    if args.report_to:
        overrides.append(f"output.report_to={args.report_to}")
    if args.quiet:
        overrides.append("output.progress=quiet")
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


def output_dir_for(cfg: Config) -> Path:
    if cfg.output.dir:
        return Path(cfg.output.dir)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    return Path("runs") / (cfg.output.name or cfg.model.preset)


# -- the trainer -----------------------------------------------------------------------------


class Trainer:
    dist: Dist
    out_dir: Path
    checkpoints: Checkpointer
    grids: SampleGrids

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def log(self, message: str) -> None:
        """An information line on rank 0 (none with --quiet)."""
        if self.dist.rank == 0 and self.cfg.output.progress != "quiet":
            print(message, flush=True)

    def warn(self, message: str) -> None:
        """A warning line on rank 0 (with --quiet too)."""
        if self.dist.rank == 0:
            print(f"warning: {message}", flush=True)

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
        """Build the run, then loop; the progress bar and the tracker close however it ends."""
        cfg = self.cfg
        check_available(cfg.output.report_to)  # every rank alike, before anything is built
        run = build_run(cfg, self.dist, self.out_dir, self.log, self.warn)
        self.checkpoints = Checkpointer(run, self.log)
        self.grids = SampleGrids(
            cfg.sample,
            cfg.data.resolution,
            run.models,
            run.ema,
            run.device,
            run.dtype,
            run.offloaded,
            self.out_dir / "samples",
        )
        log = self.open_log(run)
        try:
            return self.loop(run, log)
        finally:
            log.close()

    def loop(self, run: Run, log: TrainingLog) -> int:
        """Data -> step -> report, with a logging interval every train.log_every steps and checkpoints
        and sample grids on schedule; then the end. Returns the exit code (128 + N after signal N)."""
        cfg, d = self.cfg, self.dist
        stop = StopRequested()
        if cfg.checkpoint.on_signal:
            stop.install()
        profiler = StepProfiler(
            parse_steps(cfg.train.profile_steps), self.out_dir / "profile", d.rank, d.device
        )
        batches = Batches(run.loader, run.sampler, run.objective, profiler)
        log.start(run.step)
        self.log(
            f"training {cfg.train.max_steps} steps from step {run.step}: global batch {run.images_per_step} "
            f"= {run.train_step.micro_batch} micro x {run.train_step.grad_accum} accum x {d.world_size} ranks "
            f"| OOM guard {'on' if run.train_step.guard is not None else 'off'} "
            f"| output {self.out_dir} | setup {time.time() - run.start_time:.1f}s"
        )
        last_end = time.perf_counter()
        while run.step < cfg.train.max_steps:
            batch, data_wait = batches.next()
            samples = batch_size(batch)
            profiler.before_step(run.step + 1)
            with profiler.range("trainer: step"):
                result = run.train_step(batch, run.step + 1)
            del batch
            run.sampler.advance(samples)
            lr = run.train_step.optimizer_step.used_lr
            run.step += 1
            now = time.perf_counter()
            step_time, last_end = now - last_end, now
            if written := profiler.after_step(run.step):
                self.log(f"profile of steps {cfg.train.profile_steps}: {written}")
            log.step(run.step, result, samples, step_time, data_wait, lr)
            if log.due(run.step) and (signalled := self.logging_interval(run, log, stop)):
                self.checkpoints.save(f"signal {signal.Signals(signalled).name}")
                return 128 + signalled
            if self.scheduled(cfg.checkpoint.every, run.step):
                self.checkpoints.save("periodic")
            if self.scheduled(cfg.sample.every, run.step):
                self.samples(run, log)
            last_end = time.perf_counter()  # step_time covers data + step, not logging or saving
        return self.finish(run, log)

    def logging_interval(self, run: Run, log: TrainingLog, stop: StopRequested) -> int:
        """Every rank, every train.log_every steps: the loop's one host sync. The mean loss over the
        ranks, and the stop flag with the non-finite watch in one all-reduce (MAX). Returns the
        signal every rank stops on (0: none)."""
        log.flush()
        mean = log.window_loss()
        flag = torch.cat(
            [torch.full((1,), float(stop.signum), device=mean.device), run.train_step.watch.for_max()]
        )
        dist.all_reduce(mean)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        mean_loss = mean.item() / self.dist.world_size
        flags = flag.tolist()
        run.train_step.check_finite(flags[1:])
        grad_norm = run.train_step.optimizer_step.take_grad_norm()  # rank 0 reads it, after the sync
        log.interval(
            run.step, mean_loss, run.train_step.optimizer_step.used_lr, grad_norm, run.train_step.fallbacks
        )
        signalled = int(flags[0])
        if signalled and stop.signum == 0:
            stop.signum = signalled
        return signalled

    def scheduled(self, every: int, step: int) -> bool:
        """Whether a periodic checkpoint or sample grid falls on `step` (the end has its own)."""
        return bool(every) and step % every == 0 and step < self.cfg.train.max_steps

    def samples(self, run: Run, log: TrainingLog) -> None:
        """Every rank settles; rank 0 samples the grid (the others wait at a barrier)."""
        if not self.cfg.sample.prompts:
            return
        run.train_step.settle(run.step)
        run.train_step.check_finite()
        if self.dist.rank == 0:
            t0 = time.time()
            grid, path = self.grids(run.step)
            self.log(f"samples {path} ({time.time() - t0:.1f}s)")
            log.image("samples", grid, run.step)
        barrier()

    def finish(self, run: Run, log: TrainingLog) -> int:
        """After the last step: every rank settles and compares weights; then the end's checkpoint,
        sample grid and export."""
        cfg = self.cfg
        log.flush()
        run.train_step.settle(run.step)
        self.check_replicas(run.models.unet, run.step)
        if cfg.checkpoint.at_end:
            self.checkpoints.save("end")
        if cfg.sample.at_end:
            self.samples(run, log)
        if cfg.output.export:
            run.train_step.settle(run.step)
            run.train_step.check_finite()
            if self.dist.rank == 0:
                name = cfg.output.name or cfg.model.preset
                lora = cfg.lora if run.lora_base else None
                path = export_model(
                    run.models, run.models.unet, self.out_dir / "export", run.ema, single_file=name, lora=lora
                )
                self.log(f"exported diffusers folder {path}")
            barrier()
        self.log(f"done: {run.step} steps in {time.time() - run.start_time:.1f}s")
        return EXIT_OK

    def open_log(self, run: Run) -> TrainingLog:
        """The loop's reports; rank 0 alone has a progress display and a tracker."""
        cfg, d = self.cfg, self.dist
        progress = tracker = None
        if d.rank == 0:
            progress = Progress(cfg.output.progress, cfg.train.max_steps, d.world_size, d.device)
            name = cfg.output.name or cfg.model.preset
            tracker = open_tracker(
                cfg.output.report_to, self.out_dir, name, to_dict(cfg), run.step, self.warn
            )
        return TrainingLog(
            d.device,
            d.world_size,
            cfg.train.log_every,
            cfg.train.max_steps,
            run.images_per_step,
            progress,
            tracker,
        )

    def build_guard(self, *parts: Any) -> OOMGuard | None:
        """trainer.build.build_guard for this config: (model, unet, wrap, optimizer, extra_state,
        checkpointing_on) -> the OOM guard, or None when it is off or cannot apply."""
        return build_guard(self.cfg, self.dist.world_size, self.warn, *parts)

    def check_replicas(self, unet: torch.nn.Module, step: int) -> None:
        """Compare a digest of the UNet weights across ranks: DDP must keep them identical."""
        digest = params_digest(unet)
        sdi.event("replicas", step=step, params_sha256=digest)
        digests: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            message = f"UNet weights differ across ranks after step {step}: {digests}"
            sdi.event(EventKind.WARNING, code="replicas_differ", message=message)
            self.warn(message)


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
