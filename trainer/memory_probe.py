"""`python -m trainer.memory_probe`: the largest micro-batch that fits a card of N GiB, per setup.

    python -m trainer.memory_probe --preset sd2-base --card-gib 24 --out ./mem24
    python -m trainer.memory_probe --variants saver,lora --set train.ema_decay=0.9999

For each variant (the trainer settings of `trainer.bench.VARIANTS`, compile off) a process of its
own caps PyTorch's allocator at `card - 1` GiB (`torch.cuda.set_per_process_memory_fraction`; the
GiB left over stands for the CUDA context and library workspaces that a real card of that size
also holds), builds the models, the module the step calls, optimizer, EMA and objective with the
functions `python -m trainer` builds them with (`trainer.build`, `trainer.step.OptimizerStep`) and
trains on cached-latent-shaped batches: batch 4
first (its peak is reported), then doubling and bisection to the exact largest batch that
completes two steps (forward, backward, clipping, optimizer, EMA) without running out of memory.
It then times a few steps at that batch (images/s, without torch.compile). A variant that fails
or runs past `--timeout` is a row saying so; the others still run.

Output: a table on stdout, and with `--out DIR` DIR/memory.json and DIR/memory.md.
Exit codes: 0 every variant measured; 1 some variant failed; 2 bad arguments or no CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
#: Left for the CUDA context, cuBLAS/cuDNN workspaces and fragmentation on a card of the given size.
CONTEXT_RESERVE_GIB = 1.0
#: Most important first: a time budget drops the tail.
DEFAULT_VARIANTS = ("saver", "default", "lora", "adamw8bit", "gc", "adamw8bit-gc", "saver-8bit", "lora-gc")
RESULT = "MEMORY_PROBE "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.memory_probe",
        description="Largest micro-batch per trainer setup under a memory cap (CUDA).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="variants: names of trainer.bench.VARIANTS; exit codes: 0 all measured, 1 some failed, 2 bad input",
    )
    parser.add_argument("--preset", default="sd2-base", help="sd2-base (default) | sd15 | tiny")
    parser.add_argument("--resolution", type=int, default=0, help="pixels (default: the preset's)")
    parser.add_argument("--card-gib", type=float, default=24.0, help="card size to fit (default 24)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-batch", type=int, default=256, help="largest batch tried")
    parser.add_argument("--timed-steps", type=int, default=4, help="steps timed at the largest batch")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per variant")
    parser.add_argument(
        "--budget", type=float, default=0.0, help="skip variants that would start past S seconds"
    )
    parser.add_argument("--out", default="", help="folder for memory.json and memory.md")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child: one variant
    args = parser.parse_args(argv)
    from trainer.bench import VARIANTS

    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list + ([args.one] if args.one else []) if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    return args


# -- the child: one variant in this process ------------------------------------------------------


def probe_variant(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer.bench import VARIANTS
    from trainer.config import build_config

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = (args.card_gib - CONTEXT_RESERVE_GIB) * GIB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    settings = {"model.compile": "false", "train.ema_decay": 0.0, **VARIANTS[args.one]}
    if args.resolution:
        settings["data.resolution"] = args.resolution
    overrides = [f"{k}={_text(v)}" for k, v in settings.items()] + list(args.overrides)
    cfg = build_config(args.preset, None, overrides)
    step, state_bytes = build_step(cfg, device)
    out: dict[str, Any] = {
        "variant": args.one,
        "settings": settings,
        "extra_settings": list(args.overrides),
        "allocator_cap_gib": cap / GIB,
        "persistent_gib": state_bytes / GIB,
        "probes": [],
    }

    def fits(batch: int) -> bool:
        peak = try_batch(step, batch, device)
        out["probes"].append({"batch": batch, "fits": peak is not None, "peak_gib": peak and peak[0] / GIB})
        if peak is not None and batch == 4:
            out["batch4_peak_gib"], out["batch4_reserved_gib"] = peak[0] / GIB, peak[1] / GIB
        return peak is not None

    largest, smallest_failing = 0, 0
    batch = 4
    while batch <= args.max_batch:  # doubling from 4 (and down to 1 if 4 does not fit)
        if fits(batch):
            largest = batch
            batch *= 2
        else:
            smallest_failing = batch
            break
    if not largest:
        largest, smallest_failing = _bisect(fits, 0, smallest_failing)
    elif smallest_failing:
        largest, smallest_failing = _bisect(fits, largest, smallest_failing)
    out["largest_batch"] = largest or None
    out["fails_at"] = smallest_failing or None
    if largest:
        peak = try_batch(step, largest, device, steps=args.timed_steps, timed=True)
        if peak is not None:
            out["peak_gib"], out["reserved_gib"], out["images_s"] = peak[0] / GIB, peak[1] / GIB, peak[2]
    return out


def _bisect(fits: Any, low: int, high: int) -> tuple[int, int]:
    """(largest fitting, smallest failing) between `low` (fits, or 0) and `high` (fails)."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, high


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def build_step(cfg: Any, device: Any) -> tuple[Any, int]:
    """One training step of the trainer's setup for `cfg` (compile off), and the bytes the weights,
    gradients' owners and optimizer/EMA state hold before the first step.

    The models, the module the step calls, the optimizer, the objective and the optimizer step are
    built by the trainer's own functions (trainer.build, trainer.step), so what is measured is what
    `python -m trainer` trains; only the data (cached-latent-shaped random batches) is the probe's.
    """
    import torch

    from trainer.build import (
        build_objective,
        build_optimization,
        cast_frozen,
        load_models,
        offload_frozen,
        resolve_precision,
    )
    from trainer.models import vae_scale_factor
    from trainer.nonfinite import NonFiniteWatch
    from trainer.optim import check_optimizer
    from trainer.process import Dist
    from trainer.step import OptimizerStep

    def log(line: str) -> None:
        print(f"memory_probe: {line}", file=sys.stderr, flush=True)

    d = Dist(rank=0, local_rank=0, world_size=1, device=device, backend="none")
    # The trainer's kernel switches (cuDNN benchmark, TF32) are left at torch's defaults: the
    # probe's published tables (docs/performance.md) were measured with cuDNN benchmark off.
    dtype = resolve_precision(cfg.train.mixed_precision, device)
    check_optimizer(cfg.optim, device)
    models, unet_bf16, _, _ = load_models(cfg, d, dtype, log)
    frozen_dtype = cast_frozen(models, dtype, device)
    opt = build_optimization(cfg, d, models, dtype, unet_bf16, log)
    objective = build_objective(cfg, models, device, dtype, frozen_dtype, opt, unet_bf16)
    offload_frozen(cfg, d, models)
    watch = NonFiniteWatch(device, 0, 1)
    optimizer_step = OptimizerStep(
        opt["optimizer"], opt["lr_scheduler"], opt["params"], cfg.train.max_grad_norm, opt["scaler"],
        opt["ema"], watch, lambda: 1,  # the step number only labels a divergence, unchecked here
    )  # fmt: skip
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    side = cfg.data.resolution // vae_scale_factor(models.vae)
    latent = (models.unet.config.in_channels, side, side)
    text = (models.tokenizer.model_max_length, models.text_encoder.config.hidden_size)

    def step(batch: int) -> None:
        raw = {  # as the latent cache holds them, in the frozen models' dtype
            "latent_mean": torch.randn(batch, *latent, device=device, dtype=frozen_dtype),
            "latent_std": torch.rand(batch, *latent, device=device, dtype=frozen_dtype),
            "encoder_hidden_states": torch.randn(batch, *text, device=device, dtype=frozen_dtype),
            "caption": ["a photograph of a probe"] * batch,  # tokenized when the text encoder trains
        }
        objective.forward_backward(opt["model"], objective.prepare(raw), 1.0)
        optimizer_step()

    step.optimizer = opt["optimizer"]  # type: ignore[attr-defined]
    return step, torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def try_batch(
    step: Any, batch: int, device: Any, steps: int = 2, timed: bool = False
) -> tuple[int, int, float] | None:
    """(peak allocated, peak reserved, images/s) over `steps` steps at `batch`; None on out-of-memory."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        step(batch)  # the first step at a new shape is not timed (cuDNN benchmark, allocator growth)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps - 1 if not timed else steps):
            step(batch)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError:
        step.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return None
    runs = steps if timed else steps - 1
    return (
        torch.cuda.max_memory_allocated(device),
        torch.cuda.max_memory_reserved(device),
        batch * runs / seconds if runs else 0.0,
    )


# -- the driver: one process per variant -------------------------------------------------------


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "trainer.memory_probe", "--one", variant, "--preset", args.preset]
    cmd += ["--card-gib", str(args.card_gib), "--max-batch", str(args.max_batch)]
    cmd += ["--timed-steps", str(args.timed_steps), "--resolution", str(args.resolution)]
    for item in args.overrides:
        cmd += ["--set", item]
    started = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-2000:]
        return {"variant": variant, "error": f"timed out after {args.timeout}s", "log": str(tail)}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT) :])
            result["wall_s"] = time.time() - started
            return result
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    key = [ln for ln in lines if "error" in ln.lower()] or lines or ["(no output)"]
    return {
        "variant": variant,
        "error": f"exit {proc.returncode}: {key[-1][:200]}",
        "log": "\n".join(lines[-30:]),
    }


def format_table(report: dict[str, Any]) -> str:
    head = [
        "variant",
        "largest batch",
        "fails at",
        "peak GiB",
        "reserved GiB",
        "img/s",
        "batch 4 peak GiB",
        "state GiB",
    ]
    rows = []
    for r in report["rows"]:
        if r.get("error"):
            rows.append([r["variant"], f"FAILED: {r['error']}"])
            continue
        rows.append(
            [
                r["variant"],
                str(r.get("largest_batch") or 0),
                str(r.get("fails_at") or f">{report['max_batch']}"),
                _fmt(r.get("peak_gib"), "{:.1f}"),
                _fmt(r.get("reserved_gib"), "{:.1f}"),
                _fmt(r.get("images_s"), "{:.1f}"),
                _fmt(r.get("batch4_peak_gib"), "{:.1f}"),
                _fmt(r.get("persistent_gib"), "{:.1f}"),
            ]
        )
    lines = [
        f"{report['preset']} at {report['resolution'] or 'preset'} px on {report['device']}, allocator capped at "
        f"{report['card_gib'] - CONTEXT_RESERVE_GIB:g} GiB for a {report['card_gib']:g} GiB card, compile off, "
        f"torch {report['torch']}, {report['date']}",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("trainer.memory_probe: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.one:
        print(RESULT + json.dumps(probe_variant(args)), flush=True)
        return 0
    started = time.time()
    report: dict[str, Any] = {
        "preset": args.preset,
        "resolution": args.resolution,
        "card_gib": args.card_gib,
        "max_batch": args.max_batch,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    for variant in args.variant_list:
        if args.budget and time.time() - started > args.budget:
            report["rows"].append(
                {"variant": variant, "error": f"skipped: --budget {args.budget:g}s reached"}
            )
            continue
        row = run_variant(args, variant)
        report["rows"].append(row)
        status = row.get("error") or f"largest batch {row.get('largest_batch')}"
        print(f"memory_probe: {variant}: {status}", file=sys.stderr, flush=True)
        if args.out:
            write(args.out, report)
    report["wall_s"] = time.time() - started
    print(format_table(report), flush=True)
    if args.out:
        write(args.out, report)
    return 1 if any(r.get("error") for r in report["rows"]) else 0


def write(folder: str, report: dict[str, Any]) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "memory.md").write_text(format_table(report) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
