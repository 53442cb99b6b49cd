"""`python -m trainer.bench`: the trainer against a diffusers-style reference loop, one table.

Every measurement runs in its own process (so each peak-memory figure is that case's alone):

    reference   `python -m trainer.reference` (diffusers train_text_to_image style, trainer/reference.py)
    <variant>   `python -m trainer` (or `torchrun -m trainer`) through its real code path, telemetry
                on, with the variant's settings written out as `--set` flags (VARIANTS below)

The trainer's numbers come from its telemetry (`step` events in its run directory): throughput
is wall clock between the `step` events of the last warm-up step and the last step, both
logging steps (where the trainer synchronises with the GPU), so host run-ahead cannot flatter
it; peak memory is the largest `mem_peak` of any rank (`torch.cuda.max_memory_allocated`).

TFLOP/s uses the UNet's forward+backward FLOPs per image, counted once per run with
torch.utils.flop_counter on the meta device (no memory, ~1 s); share of peak divides by a bf16
matmul measured on the same GPU in the same run. Scaling efficiency = images/s(N) / (N x images/s(1))
for the same case at the same per-GPU batch.

Exit codes: 0 every case measured; 1 some case failed (the table marks it, the log says why);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_BAD_INPUT = 2

GIB = 2**30

#: Settings that only pin a value the trainer had before the key existed: left out for a trainer
#: that does not know the key (so the anchor variants run on any trainer version).
PINNED_DEFAULTS: dict[str, Any] = {"model.unet_dtype": "fp32"}

_FP32 = {"model.unet_dtype": "fp32"}
# The SD presets compile the UNet on CUDA by default; the variants that measure one switch without
# compile say so, the `*-compiled` ones and `default` do not need to.
_EAGER = {"model.compile": "false"}

#: Trainer settings per variant, on top of the common settings `common_settings` writes.
#: Keys that the trainer does not know (yet) make that case fail with a clear row, not the bench.
VARIANTS: dict[str, dict[str, Any]] = {
    # the trainer as it comes: nothing but the common settings
    "default": {},
    # the same without collective tracing and the OOM guard (telemetry stays: the bench reads it),
    # for the instrumentation's on/off cost: run it next to `default` at the same batch
    "uninstrumented": {"train.trace_collectives": False, "train.oom_guard": False},
    # the earlier 97.8 images/s anchor: cached latents + embeddings, channels_last, fused AdamW
    "cached": {"data.cache": True, "model.channels_last": True, "optim.fused": "true", **_FP32, **_EAGER},
    "compiled": {
        "data.cache": True,
        "model.channels_last": True,
        "optim.fused": "true",
        "model.compile": "true",
        **_FP32,
    },
    # bf16 UNet weights, fp32 master weights in the optimizer
    "bf16w": {"data.cache": True, "model.channels_last": True, "model.unet_dtype": "bf16", **_EAGER},
    "bf16w-compiled": {
        "data.cache": True,
        "model.channels_last": True,
        "model.unet_dtype": "bf16",
        "model.compile": "true",
    },
    "bf16w-autotune": {
        "data.cache": True,
        "model.channels_last": True,
        "model.unet_dtype": "bf16",
        "model.compile": "true",
        "model.compile_mode": "max-autotune-no-cudagraphs",
    },
    "bf16w-cudagraphs": {
        "data.cache": True,
        "model.channels_last": True,
        "model.unet_dtype": "bf16",
        "model.compile": "true",
        "model.compile_mode": "reduce-overhead",
    },
    "contiguous": {
        "data.cache": True,
        "model.channels_last": False,
        "optim.fused": "true",
        **_FP32,
        **_EAGER,
    },
    "checkpointing": {"data.cache": True, "model.gradient_checkpointing": True, **_FP32, **_EAGER},
    # gradient checkpointing, bf16 weights and optimizer state, VAE/text encoder off the GPU
    "saver": {"train.memory_saver": True},
}
VARIANTS["best"] = dict(VARIANTS["bf16w-compiled"])
# memory levers (trainer.memory_probe runs them with compile off): gradient checkpointing alone,
# bitsandbytes' 8-bit AdamW (fp32 weights under autocast, 8-bit moments), with checkpointing, and
# under the memory saver; LoRA rank 16 on the default target layers (frozen bf16 UNet), and on the
# text encoder as well
VARIANTS.update(
    {
        "gc": {"model.gradient_checkpointing": True},
        "adamw8bit": {"optim.name": "adamw8bit"},
        "adamw8bit-gc": {"optim.name": "adamw8bit", "model.gradient_checkpointing": True},
        "saver-8bit": {"train.memory_saver": True, "optim.name": "adamw8bit"},
        "lora": {"lora.rank": 16},
        "lora-gc": {"lora.rank": 16, "model.gradient_checkpointing": True},
        # the text encoder's adapters too (EMA off: it averages the UNet only)
        "lora-te": {"lora.rank": 16, "lora.text_encoder": True, "train.ema_decay": 0.0},
    }
)
# speed levers against `default` (compiled): CUDA graphs for the launch gaps of the compiled
# backward, Triton autotuning, each attention kernel for attention's backward, Inductor options
VARIANTS.update(
    {
        "default-cudagraphs": {"model.compile_mode": "reduce-overhead"},
        # diffusers' own resnet and transformer forwards, with their NCHW copies of channels_last
        # activations (trainer/unet_layout.py): what `default` ran before the trainer dropped them
        "default-diffusers-layout": {"model.keep_channels_last": False},
        "default-autotune": {"model.compile_mode": "max-autotune-no-cudagraphs"},
        # the matmul and convolution kernels chosen by timing (cuBLAS, cuDNN, Triton templates)
        # without that mode's coordinate-descent tuning of every kernel, whose compile did not
        # finish (see default-coordtune)
        "default-gemm-autotune": {"model.compile_options": ["max_autotune=true"]},
        "default-flash": {"model.attention_backend": "flash"},
        "default-cudnn": {"model.attention_backend": "cudnn"},
        "default-efficient": {"model.attention_backend": "efficient"},
        # N-D tiled pointwise kernels: the up-blocks' GroupNorm + SiLU kernels read their
        # channels_last input C elements apart without it (benchmarks/unet_kernels.py)
        "default-ndtiling": {"model.compile_options": ["triton.prefer_nd_tiling=true"]},
        # each Triton kernel's block sizes tuned by timing their neighbours (the norm kernels'
        # launch configuration is what makes the up-blocks' GroupNorm slow)
        "default-coordtune": {"model.compile_options": ["coordinate_descent_tuning=true"]},
        # the compiled graphs' host side in C++ instead of Python: aimed at the gaps while the
        # host launches the compiled backward's kernels (its compile fails on torch 2.11, see
        # docs/performance.md)
        "default-cppwrapper": {"model.compile_options": ["cpp_wrapper=true"]},
    }
)

#: The bench's default plan when --cases is not given: every loop at every batch.
DEFAULT_LOOPS = ("reference", "default", "best")


@dataclasses.dataclass
class Case:
    loop: str
    """reference, or a trainer variant name."""
    batch: int
    nproc: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra trainer settings (DDP sweep)."""
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.loop


@dataclasses.dataclass
class Row:
    case: Case
    ok: bool
    error: str = ""
    it_s: float | None = None
    images_s: float | None = None
    mem_peak: int | None = None
    data_wait: float | None = None
    seconds: float = 0.0
    log: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self, flops_per_image: float | None, peak_tflops: float | None) -> dict[str, Any]:
        n = self.case.nproc
        tflops = self.images_s * flops_per_image / 1e12 if self.images_s and flops_per_image else None
        return {
            "case": self.case.name,
            "loop": self.case.loop,
            "gpus": n,
            "per_gpu_batch": self.case.batch,
            "global_batch": self.case.batch * n,
            "settings": self.case.extra,
            "ok": self.ok,
            "error": self.error or None,
            "it_s": self.it_s,
            "images_s": self.images_s,
            "images_s_per_gpu": self.images_s / n if self.images_s else None,
            "peak_gib_per_gpu": self.mem_peak / GIB if self.mem_peak else None,
            "tflops": tflops,
            "share_of_peak": tflops / peak_tflops if tflops and peak_tflops else None,
            "data_wait_share": self.data_wait,
            "wall_s": self.seconds,
            "log": self.log,
            **self.extra,
        }


# -- arguments -------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# Over 80 lines: one declaration per option, with its help; split up, the command line would be
# harder to read as a whole.
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.bench",
        description="Measure the bundled trainer against a diffusers-style reference loop on the same GPU(s).",
        epilog=f"""\
examples:
  python -m trainer.bench --preset sd2-base --batch 16,32
  python -m trainer.bench --preset sd2-base --cases reference@32,default@32,best@32,best@48,saver@4
  python -m trainer.bench --preset sd2-base --nproc 1,8 --batch 32 --sweep-ddp
  python -m trainer.bench --preset sd2-base --cases saver@4 --find-max-batch 24
  python -m trainer.bench --preset tiny --nproc 1,2 --steps 4 --warmup 2 --json   (CPU, gloo)

cases: LOOP@BATCH, LOOP = reference or a trainer variant: {", ".join(VARIANTS)}.
  Variants are named sets of trainer --set flags (see trainer/bench.py); --set adds to all of them.
timing: --warmup steps untimed (compilation, allocator warm-up), then --steps timed; the trainer's
  logging interval is set to divide both, so the window starts and ends on a GPU synchronisation.
output: the table on stdout (--json: JSON instead); --out FILE also writes the JSON; each case's
  log and run directory under --workdir.
exit codes: 0 every case measured, 1 some case failed (marked in the table), 2 bad arguments
""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="tiny", help="tiny (default) | sd15 | sd2-base | sd2 (768-v)")
    parser.add_argument("--resolution", type=int, default=0, help="pixels (default: 32 for tiny, else 512)")
    parser.add_argument("--batch", type=_int_list, default=None, help="per-GPU batches, e.g. 8,16,32")
    parser.add_argument("--nproc", type=_int_list, default=[1], help="GPU (rank) counts, e.g. 1,2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per case (at least 1)")
    parser.add_argument(
        "--loops",
        default=",".join(DEFAULT_LOOPS),
        help="loops measured at every --batch: reference and/or trainer variants (default: %(default)s)",
    )
    parser.add_argument("--cases", default="", help="explicit LOOP@BATCH list instead of --loops x --batch")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer setting for every trainer case (repeatable)",
    )
    parser.add_argument(
        "--sweep-ddp", action="store_true", help="bucket_cap_mb x gradient_as_bucket_view sweep"
    )
    parser.add_argument(
        "--ddp-buckets", type=_int_list, default=[25, 50, 100, 200], help="MB values to sweep"
    )
    parser.add_argument(
        "--find-max-batch",
        type=float,
        default=0.0,
        metavar="GIB",
        help="largest batch of the --max-batch-variant that fits a card of GIB GiB (bisection, CUDA)",
    )
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="run every case as on a card of GIB GiB: the allocator capped at GIB - 1 (CUDA)",
    )
    parser.add_argument("--max-batch-variant", default="saver", help="variant for --find-max-batch")
    parser.add_argument("--max-probes", type=int, default=6, help="probe runs for --find-max-batch")
    parser.add_argument("--max-batch-start", type=int, default=4, help="first batch --find-max-batch tries")
    parser.add_argument("--workdir", default="", help="logs and run directories (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per case before it is stopped")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.0,
        metavar="S",
        help="wall-clock budget in seconds: cases that would start past it are skipped (0: none)",
    )
    parser.add_argument(
        "--gpu-idle",
        action="store_true",
        help="profile the last two warm-up steps of every trainer case (train.profile_steps) and report "
        "how much of the step the GPU sat idle between kernels (CUDA; needs --warmup 4 or more)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", default="", help="also write the JSON to FILE (and the table to FILE.txt)")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the options cannot mean together (parser.error: exit 2), fill in the preset's
    defaults and build `args.case_list`."""
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the window starts at the last warm-up step)")
    if args.gpu_idle and args.warmup < 4:
        parser.error(
            "--gpu-idle profiles the last two warm-up steps after two untouched ones: use --warmup 4 or more"
        )
    if args.preset not in ("tiny", "sd15", "sd2-base", "sd2"):
        parser.error(f"unknown --preset {args.preset!r}; valid: tiny, sd15, sd2-base, sd2")
    if not args.resolution:
        args.resolution = 32 if args.preset == "tiny" else 512
    if args.batch is None:
        args.batch = [8] if args.preset == "tiny" else [16, 32]
    try:
        args.case_list = build_cases(args)
    except ValueError as exc:
        parser.error(str(exc))
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    if args.cases == "none":
        pass  # e.g. only --find-max-batch
    elif args.cases:
        for item in args.cases.split(","):
            loop, sep, batch = item.strip().partition("@")
            if not sep or not batch.isdigit() or int(batch) < 1:
                raise ValueError(f"--cases expects LOOP@BATCH items, got {item!r} (e.g. best@32)")
            _check_loop(loop)
            for n in args.nproc:
                cases.append(Case(loop, int(batch), n))
    else:
        loops = [x.strip() for x in args.loops.split(",") if x.strip()]
        for loop in loops:
            _check_loop(loop)
        for n in args.nproc:
            for batch in args.batch:
                cases.extend(Case(loop, batch, n) for loop in loops)
    if args.sweep_ddp:
        n = max(args.nproc)
        if n < 2:
            raise ValueError("--sweep-ddp needs --nproc with at least 2 ranks")
        trainer_cases = [c for c in cases if c.loop != "reference" and c.nproc == n]
        if not trainer_cases:
            raise ValueError("--sweep-ddp needs a trainer case (a variant in --loops or --cases)")
        base = trainer_cases[0]
        for mb in args.ddp_buckets:
            for view in (True, False):
                extra = {"ddp.bucket_cap_mb": mb, "ddp.gradient_as_bucket_view": view}
                label = f"{base.loop} bucket={mb}MB view={'on' if view else 'off'}"
                cases.append(Case(base.loop, base.batch, n, extra, label))
    return cases


def _check_loop(loop: str) -> None:
    if loop != "reference" and loop not in VARIANTS:
        raise ValueError(f"unknown loop {loop!r}; valid: reference, {', '.join(VARIANTS)}")


# -- running one case ------------------------------------------------------------------------


def child_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("SDDOCTOR_RUN_DIR", None)  # each case writes its own run directory
    env.setdefault("SDDOCTOR_CACHE_DIR", str(workdir / "latents"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launcher(nproc: int, module: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        module,
    ]


def log_interval(warmup: int, steps: int) -> int:
    """Largest interval <= 10 dividing both, so the window's ends are logging (synchronising) steps."""
    g = math.gcd(warmup, steps)
    return max(d for d in range(1, min(g, 10) + 1) if g % d == 0)


def common_settings(args: argparse.Namespace, case: Case, total_steps: int) -> dict[str, Any]:
    """What every trainer case shares with the reference loop; the variant adds to it."""
    return {
        "data.source": "digits",
        "data.resolution": args.resolution,
        # one data set for every case, so the latent cache is built once and then hit (a miss
        # under --find-max-batch would measure the cache build's memory, not training's)
        "data.max_samples": max(2 * case.batch * case.nproc, 64 if args.preset == "tiny" else 256),
        "train.micro_batch": case.batch,
        "train.grad_accum": 1,
        "train.max_steps": total_steps,
        "train.log_every": log_interval(args.warmup, args.steps),
        "train.ema_decay": 0.0,  # the reference (diffusers' default) keeps no EMA
        "train.max_grad_norm": 1.0,
        "model.vae_warmup_steps": 0,
        "optim.warmup_steps": 0,
        "sample.at_end": False,
        "sample.every": 0,
        "checkpoint.at_end": False,
        "checkpoint.every": 0,
        "output.export": False,
    }


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # --set's list form: entries separated by ';'
        return ";".join(map(_fmt, value))
    return str(value)


def trainer_knows(key: str) -> bool:
    """Whether the trainer's config tree has the dotted `key`."""
    from trainer.config import Config

    node: Any = Config()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def trainer_command(
    args: argparse.Namespace, case: Case, run_dir: Path, steps: int, warmup: int
) -> list[str]:
    settings = common_settings(args, case, warmup + steps)
    settings.update(VARIANTS[case.loop])
    settings.update(case.extra)
    if args.gpu_idle and warmup >= 4:
        # inside the warm-up: profiled steps are slower, and the window starts at step `warmup`
        settings["train.profile_steps"] = f"{warmup - 2}-{warmup - 1}"
    for key, value in PINNED_DEFAULTS.items():
        if settings.get(key) == value and not trainer_knows(key):
            del settings[key]
    flags = [f"{k}={_fmt(v)}" for k, v in settings.items()] + list(args.overrides)
    return [
        *launcher(case.nproc, "trainer"),
        "--preset",
        args.preset,
        "--output-dir",
        str(run_dir),
        "--set",
        *flags,
    ]


def reference_command(args: argparse.Namespace, case: Case, json_out: Path) -> list[str]:
    return [
        *launcher(case.nproc, "trainer.reference"),
        "--preset",
        args.preset,
        "--resolution",
        str(args.resolution),
        "--batch",
        str(case.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--json-out",
        str(json_out),
        # tiny images cost nothing to decode; loader workers would only crowd small CPU runs
        "--num-workers",
        "0" if args.preset == "tiny" else "4",
    ]


def run_logged(
    command: list[str], env: dict[str, str], log: Path, timeout: int, wrapper: str = ""
) -> tuple[int, str]:
    """Run `command` with output to `log`; (exit code, last lines). The process group is reaped on timeout."""
    if wrapper:
        command = [sys.executable, "-c", wrapper, *command[1:]]
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            code = 124
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-12:]
    return code, "\n".join(tail)


def _failure(code: int, tail: str) -> str:
    if code == 124:
        return "timed out"
    lines = [ln for ln in tail.splitlines() if ln.strip()]
    key = [ln for ln in lines if "error" in ln.lower() or "Error" in ln]
    return f"exit {code}: {(key or lines or ['(no output)'])[-1].strip()[:200]}"


def measure_trainer_run(run_dir: Path, warmup: int, total: int) -> dict[str, Any]:
    """images/s, it/s, peak memory and data-wait share from the run's step events."""
    from sddoctor.telemetry.reader import RunView

    view = RunView.load(run_dir)
    if not view.ranks:
        raise RuntimeError(f"no telemetry in {run_dir}")
    window_images = 0
    mem_peak: int | None = None
    t0 = t1 = None
    step_time = data_wait = 0.0
    has_wait = False
    micro = set()
    for rank, rv in sorted(view.ranks.items()):
        steps = {e["step"]: e for e in rv.of_kind("step")}
        if warmup not in steps or total not in steps:
            raise RuntimeError(f"rank {rank} reported no step {warmup} or {total} (got {len(steps)} steps)")
        for s in range(warmup + 1, total + 1):
            event = steps.get(s, {})
            window_images += int(event.get("samples") or 0)
            micro.add(event.get("micro_batch"))
            if rank == 0:
                step_time += float(event.get("step_time") or 0.0)
                if event.get("data_wait") is not None:
                    has_wait = True
                    data_wait += float(event["data_wait"])
        peaks = [peak for e in steps.values() if (peak := e.get("mem_peak"))]
        if peaks:
            mem_peak = max(mem_peak or 0, max(peaks))
        if rank == 0:
            t0, t1 = steps[warmup]["t"], steps[total]["t"]
    if t0 is None or t1 is None:
        raise RuntimeError(f"rank 0 reported no steps in {run_dir}")
    seconds = max(float(t1) - float(t0), 1e-9)
    fallbacks = sum(len(rv.of_kind("fallback")) for rv in view.ranks.values())
    return {
        "it_s": (total - warmup) / seconds,
        "images_s": window_images / seconds,
        "mem_peak": mem_peak,
        "data_wait": data_wait / step_time if has_wait and step_time > 0 else None,
        "micro_batches": sorted(m for m in micro if m is not None),
        "fallbacks": fallbacks,
    }


def run_case(
    args: argparse.Namespace,
    case: Case,
    workdir: Path,
    index: int,
    wrapper: str = "",
    steps: int | None = None,
    warmup: int | None = None,
    env_extra: dict[str, str] | None = None,
) -> Row:
    """Run one case in its own process(es) and measure it; a failure becomes a row, never an exception."""
    steps = steps or args.steps
    warmup = warmup or args.warmup
    slug = f"{index:02d}-{case.name.replace(' ', '_').replace('=', '')}-b{case.batch}-n{case.nproc}"
    log = workdir / f"{slug}.log"
    env = child_env(workdir)
    env.update(env_extra or {})
    started = time.time()
    if case.loop == "reference":
        out = workdir / f"{slug}.json"
        code, tail = run_logged(reference_command(args, case, out), env, log, args.timeout, wrapper)
        row = Row(case, ok=code == 0 and out.is_file(), seconds=time.time() - started, log=str(log))
        if row.ok:
            data = json.loads(out.read_text(encoding="utf-8"))
            row.it_s, row.images_s, row.mem_peak = data["it_s"], data["images_s"], data.get("mem_peak")
            row.extra = {"attention": data.get("attention")}
        else:
            row.error = _failure(code, tail)
        return row
    run_dir = workdir / slug
    shutil.rmtree(run_dir, ignore_errors=True)
    command = trainer_command(args, case, run_dir, steps, warmup)
    code, tail = run_logged(command, env, log, args.timeout, wrapper)
    row = Row(case, ok=code == 0, seconds=time.time() - started, log=str(log))
    if code != 0:
        row.error = _failure(code, tail)
        return row
    try:
        m = measure_trainer_run(run_dir, warmup, warmup + steps)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        row.ok, row.error = False, f"unreadable telemetry: {exc}"
        return row
    row.it_s, row.images_s, row.mem_peak, row.data_wait = (
        m["it_s"],
        m["images_s"],
        m["mem_peak"],
        m["data_wait"],
    )
    row.extra = {"run_dir": str(run_dir), "fallbacks": m["fallbacks"], "micro_batches": m["micro_batches"]}
    if args.gpu_idle:
        row.extra.update(read_gpu_idle(run_dir))
    if m["fallbacks"] or m["micro_batches"] != [case.batch]:
        row.extra["note"] = "the OOM guard lowered the micro-batch"
    return row


def read_gpu_idle(run_dir: Path) -> dict[str, Any]:
    """The idle figures of rank 0's step profile (trainer.step_profile): ms per step the GPU waited
    between its kernels and that share of the profiled step; None where there is no GPU timeline."""
    path = run_dir / "profile" / "rank-0.json"
    out: dict[str, Any] = {"gpu_idle_share": None, "gpu_idle_ms_per_step": None, "profile": None}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out
    out["profile"] = str(path.with_suffix(".txt"))
    idle = summary.get("idle")
    if idle and summary.get("per_step_ms"):
        out["gpu_idle_ms_per_step"] = idle["ms_per_step"]
        out["gpu_idle_share"] = idle["ms_per_step"] / summary["per_step_ms"]
    return out


# -- device facts: GPU name, matmul peak, FLOPs per image ------------------------------------------

_PROBE = r"""
import json, time, torch
out = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
if out["cuda"]:
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, total_memory=p.total_memory)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 50 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12)
    out["peak_tflops"] = best
else:
    out.update(device="cpu", total_memory=None, peak_tflops=None)
print("PROBE " + json.dumps(out))
"""


def probe_device(env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    for line in result.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"device": "unknown", "peak_tflops": None, "error": result.stderr.strip()[-300:]}


def unet_flops_per_image(preset: str, resolution: int) -> float:
    """Forward+backward FLOPs of one image through the preset's UNet (flop counter, meta device)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.models import ARCHITECTURES, build_unet

    arch = ARCHITECTURES[preset]
    with torch.device("meta"):
        unet = build_unet(arch["unet"])
    factor = 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
    side = resolution // factor
    latents = torch.randn(1, arch["unet"]["in_channels"], side, side, device="meta")
    hidden = torch.randn(
        1, arch["tokenizer"]["model_max_length"], arch["unet"]["cross_attention_dim"], device="meta"
    )
    timesteps = torch.zeros(1, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        unet(latents, timesteps, hidden).sample.float().pow(2).mean().backward()
    return float(counter.get_total_flops())


# -- largest batch under a memory cap --------------------------------------------------------------

_CAP_WRAPPER = """
import os, runpy, sys, torch
cap = float(os.environ["SDDOCTOR_BENCH_CAP_BYTES"])
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(i).total_memory), i)
sys.argv = sys.argv[2:]  # ["-c", "-m", MODULE, args...] -> [MODULE, args...]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

#: Left for the CUDA context, cuBLAS/cuDNN workspaces and fragmentation on a card of the given size.
CONTEXT_RESERVE_GIB = 1.0


def capped(card_gib: float) -> dict[str, Any]:
    """run_case's arguments that run a case under the allocator cap of a `card_gib` card (none for 0)."""
    if not card_gib:
        return {}
    cap = (card_gib - CONTEXT_RESERVE_GIB) * GIB
    return {"wrapper": _CAP_WRAPPER, "env_extra": {"SDDOCTOR_BENCH_CAP_BYTES": str(cap)}}


def find_max_batch(args: argparse.Namespace, workdir: Path, start_index: int) -> dict[str, Any]:
    """Doubling then bisection over the batch; each probe is a short trainer run under an allocator cap."""
    cap = (args.find_max_batch - CONTEXT_RESERVE_GIB) * GIB
    probes: list[dict[str, Any]] = []
    fits, fails = 0, 0
    batch = args.max_batch_start
    index = start_index

    def probe(b: int) -> bool | None:
        nonlocal index
        index += 1
        case = Case(args.max_batch_variant, b, 1, label=f"maxbatch-{args.max_batch_variant}")
        row = run_case(args, case, workdir, index, steps=2, warmup=1, **capped(args.find_max_batch))
        text = Path(row.log).read_text(encoding="utf-8", errors="replace") if row.log else ""
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        fitted = row.ok and not row.extra.get("note")
        probes.append(
            {
                "batch": b,
                "fits": fitted,
                "peak_gib": row.mem_peak / GIB if row.mem_peak else None,
                "error": None if fitted or oom else row.error,
                "log": row.log,
            }
        )
        if not fitted and not oom:
            return None  # a failure that is not memory: stop searching
        return fitted

    while len(probes) < args.max_probes:
        verdict = probe(batch)
        if verdict is None:
            break
        if verdict:
            fits = batch
        else:
            fails = batch
        if fails and fails - fits <= 1:
            break
        batch = next_probe(fits, fails, [(p["batch"], p["peak_gib"]) for p in probes if p["fits"]], cap / GIB)
    return {
        "card_gib": args.find_max_batch,
        "allocator_cap_gib": cap / GIB,
        "variant": args.max_batch_variant,
        "largest_fitting_batch": fits or None,
        "smallest_failing_batch": fails or None,
        "exact": bool(fails) and fails - fits == 1,
        "probes": probes,
    }


def next_probe(fits: int, fails: int, points: list[tuple[int, float | None]], cap_gib: float) -> int:
    """The next batch to try: a straight-line guess from two fitting peaks, kept inside (fits, fails).

    Peak memory grows about linearly with the batch (fixed weights and optimizer state plus
    activations per image), so two fitting probes predict the limit; doubling before that, and
    plain bisection when there is no usable prediction.
    """
    known = sorted((b, peak) for b, peak in points if peak)
    guess = 0
    if len(known) >= 2:
        (b1, p1), (b2, p2) = known[-2], known[-1]
        per_image = (p2 - p1) / (b2 - b1) if b2 != b1 else 0.0
        if per_image > 0:
            guess = int(b2 + (cap_gib - p2) / per_image)
    if not fails:
        return max(fits + 1, min(guess, 4 * fits)) if guess else 2 * fits
    # a guess at the edge of the interval would creep one batch at a time: bisect instead
    return guess if fits + 1 < guess < fails - 1 else (fits + fails) // 2


# -- the table --------------------------------------------------------------------------------------


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency against the same case on one GPU; speed-up against the reference at the same batch."""
    single = {(r["case"], r["per_gpu_batch"]): r for r in rows if r["gpus"] == 1 and r["ok"]}
    reference = {(r["gpus"], r["per_gpu_batch"]): r for r in rows if r["loop"] == "reference" and r["ok"]}
    for r in rows:
        r["scaling_efficiency"] = None
        r["vs_reference"] = None
        if not r["ok"]:
            continue
        one = single.get((r["case"], r["per_gpu_batch"]))
        if r["gpus"] > 1 and one is None and "bucket=" in r["case"]:
            one = single.get((r["loop"], r["per_gpu_batch"]))
        if r["gpus"] > 1 and one and one["images_s"]:
            r["scaling_efficiency"] = r["images_s"] / (r["gpus"] * one["images_s"])
        ref = reference.get((r["gpus"], r["per_gpu_batch"]))
        if ref and r["loop"] != "reference" and ref["images_s"]:
            r["vs_reference"] = r["images_s"] / ref["images_s"]


COLUMNS = [
    ("case", "case", "{}"),
    ("gpus", "GPUs", "{}"),
    ("per_gpu_batch", "batch/GPU", "{}"),
    ("global_batch", "global", "{}"),
    ("it_s", "it/s", "{:.2f}"),
    ("images_s", "images/s", "{:.1f}"),
    ("images_s_per_gpu", "img/s/GPU", "{:.1f}"),
    ("peak_gib_per_gpu", "peak GiB/GPU", "{:.1f}"),
    ("tflops", "TFLOP/s", "{:.3g}"),
    ("share_of_peak", "% peak", "{:.1%}"),
    ("scaling_efficiency", "scaling", "{:.1%}"),
    ("vs_reference", "vs ref", "{:.2f}x"),
    ("data_wait_share", "data wait", "{:.1%}"),
]
#: shown when the run asked for it (--gpu-idle)
GPU_IDLE_COLUMN = ("gpu_idle_share", "GPU idle", "{:.1%}")


def format_table(report: dict[str, Any]) -> str:
    columns = COLUMNS + ([GPU_IDLE_COLUMN] if report.get("gpu_idle") else [])
    header = [title for _, title, _ in columns]
    body = []
    for r in report["rows"]:
        if not r["ok"]:
            body.append(
                [
                    r["case"],
                    str(r["gpus"]),
                    str(r["per_gpu_batch"]),
                    str(r["global_batch"]),
                    f"FAILED: {r['error']}",
                ]
                + [""] * (len(columns) - 5)
            )
            continue
        cells = []
        for key, _, fmt in columns:
            value = r.get(key)
            cells.append("-" if value is None else fmt.format(value))
        body.append(cells)
    widths = [
        max([len(h), *(len(b[i]) for b in body if not b[4].startswith("FAILED") or i < 5)])
        for i, h in enumerate(header)
    ]
    lines = [
        f"{report['preset']} at {report['resolution']} px on {report['device']} | torch {report.get('torch')} | "
        f"UNet fwd+bwd {report['tflop_per_image']:.4g} TFLOP/image | "
        f"bf16 matmul peak {_maybe(report.get('peak_tflops'), '{:.0f} TFLOP/s')} | "
        f"{report['warmup']} warm-up + {report['steps']} timed steps"
        + (f" | as on a {report['cap_gib']:g} GiB card" if report.get("cap_gib") else ""),
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
    ]
    for b in body:
        if b[4].startswith("FAILED"):
            lines.append("  ".join(c.rjust(w) for c, w in zip(b[:4], widths[:4], strict=True)) + "  " + b[4])
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)))
    for r in report["rows"]:
        if r.get("note"):
            smaller = ", ".join(str(b) for b in r.get("micro_batches") or [])
            lines.append(
                f"{r['case']}@{r['per_gpu_batch']}: {r['note']}"
                + (f" (to {smaller})" if smaller else "")
                + f", same effective batch; see {r.get('log') or 'its log'}"
            )
    mb = report.get("max_batch")
    if mb:
        lines.append(
            f"largest batch of '{mb['variant']}' that fits {mb['card_gib']:g} GiB "
            f"(allocator cap {mb['allocator_cap_gib']:.1f} GiB): {mb['largest_fitting_batch']}"
            + (f" (fails at {mb['smallest_failing_batch']})" if mb.get("smallest_failing_batch") else "")
            + ("" if mb.get("exact") else " (search incomplete)")
        )
    return "\n".join(lines)


def _maybe(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


# -- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="sddoctor-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = child_env(workdir)
    started = time.time()
    device = probe_device(env)
    flops = unet_flops_per_image(args.preset, args.resolution)
    rows: list[Row] = []
    for index, case in enumerate(args.case_list):
        elapsed = time.time() - started
        typical = max((r.seconds for r in rows), default=0.0)
        if args.budget and elapsed + typical > args.budget:
            row = Row(case, ok=False, error=f"skipped: --budget {args.budget:g}s reached")
        else:
            row = run_case(args, case, workdir, index, **capped(args.cap_gib))
        rows.append(row)
        status = f"{row.images_s:.1f} images/s" if row.ok else row.error
        print(
            f"bench: {case.name} batch {case.batch} x {case.nproc}: {status} ({row.seconds:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        if args.out:  # partial results survive a bench that is stopped from outside
            partial = dict(make_report(args, device, flops, rows, workdir, started), partial=True)
            write_outputs(args.out, partial)
    report = make_report(args, device, flops, rows, workdir, started)
    if args.find_max_batch:
        if not device.get("cuda"):
            print("bench: --find-max-batch needs CUDA; skipped", file=sys.stderr)
        elif args.budget and time.time() - started > args.budget:
            print("bench: --find-max-batch skipped: --budget reached", file=sys.stderr)
        else:
            report["max_batch"] = find_max_batch(args, workdir, len(rows))
    report["wall_s"] = time.time() - started
    print(json.dumps(report, indent=2) if args.json else format_table(report), flush=True)
    if args.out:
        write_outputs(args.out, report)
    failed = [r for r in report["rows"] if not r["ok"]]
    return EXIT_SOME_FAILED if failed else EXIT_OK


def make_report(
    args: argparse.Namespace,
    device: dict[str, Any],
    flops: float,
    rows: list[Row],
    workdir: Path,
    started: float,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "preset": args.preset,
        "resolution": args.resolution,
        "device": device.get("device"),
        "torch": device.get("torch"),
        "total_memory_gib": device["total_memory"] / GIB if device.get("total_memory") else None,
        "peak_tflops": device.get("peak_tflops"),
        "tflop_per_image": flops / 1e12,
        "steps": args.steps,
        "warmup": args.warmup,
        "gpu_idle": args.gpu_idle,
        "cap_gib": args.cap_gib or None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workdir": str(workdir),
        "rows": [r.as_dict(flops, device.get("peak_tflops")) for r in rows],
    }
    add_comparisons(report["rows"])
    report["wall_s"] = time.time() - started
    return report


def write_outputs(path: str, report: dict[str, Any]) -> None:
    """The JSON at `path` and the table at `path`.txt."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Path(path + ".txt").write_text(format_table(report) + "\n", encoding="utf-8")


if __name__ == "__main__":
    from trainer import exit_if_stack_missing

    exit_if_stack_missing("trainer.bench")
    raise SystemExit(main())
