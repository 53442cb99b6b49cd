"""Where a training step's time goes: torch.profiler over a few steps, summed by kernel kind.

    --set train.profile_steps=11-13      record steps 11 to 13 (1-based, inclusive)

Each rank writes, under OUTPUT_DIR/profile/:
- `rank-N.txt`: the share of device time per kind of work (convolution, matmul, attention,
  normalisation, elementwise, optimizer, copies and layout changes, communication), how busy the
  device was over the recorded window, and the 30 most expensive kernels;
- `rank-N.json`: the same figures for scripts;
- `rank-N.trace.json.gz`: the full trace, for chrome://tracing or Perfetto.

On CUDA the figures are GPU kernel times; on a CPU, the self time of each operator. The profiled
steps run slower than the others (the profiler records every kernel launch), so a throughput
measurement should not include them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# First match wins, so the specific kinds come before the generic ones (a cuDNN convolution kernel's
# name contains "gemm", a flash-attention kernel may contain "fwd").
KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("communication", ("nccl", "c10d::", "gloo")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "implicit_gemm", "cudnn")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_sgd", "clip_grad")),
    (
        "normalisation",
        (
            "group_norm",
            "groupnorm",
            "layer_norm",
            "layernorm",
            "batch_norm",
            "rowwisemoments",
            "computeinternalgradients",
            "backwardfusedparams",
            "gammabeta",
            "computefusedparams",
            "norm_",
        ),
    ),
    (
        "matmul",
        ("gemm", "nvjet", "cutlass", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "linear"),
    ),
    (
        "copies and layout",
        (
            "copy",
            "memcpy",
            "memset",
            "nchwtonhwc",
            "nhwctonchw",
            "transpose",
            "contiguous",
            "catarray",
            "aten::cat",
        ),
    ),
    ("elementwise and other", ("",)),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(n in lowered for n in needles):
            return kind
    return KINDS[-1][0]


def parse_steps(text: str) -> tuple[int, int] | None:
    """'11-13' -> (11, 13); '12' -> (12, 12); '' -> None. ValueError names what is wrong."""
    text = text.strip()
    if not text:
        return None
    first, _, last = text.partition("-")
    try:
        start, end = int(first), int(last or first)
    except ValueError:
        raise ValueError(
            f"train.profile_steps={text!r}: expected FIRST-LAST step numbers, e.g. 11-13"
        ) from None
    if start < 1 or end < start:
        raise ValueError(
            f"train.profile_steps={text!r}: steps count from 1 and LAST must not be before FIRST"
        )
    return start, end


@dataclass
class KernelTime:
    name: str
    kind: str
    calls: int
    us: float


def summarise(
    kernels: list[KernelTime], window_us: float, steps: int, device: str, busy_us: float = 0.0
) -> dict[str, Any]:
    """Shares per kind, device busy time over the window (`busy_us`: union of compute kernels), the
    costliest kernels."""
    total = sum(k.us for k in kernels)
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.us
    return {
        "device": device,
        "steps": steps,
        "window_ms": round(window_us / 1000, 3),
        "per_step_ms": round(window_us / 1000 / max(steps, 1), 3),
        "busy_share": round(busy_us / window_us, 4) if window_us > 0 and busy_us > 0 else None,
        "kinds": {
            kind: {
                "ms_per_step": round(us / 1000 / max(steps, 1), 3),
                "share": round(us / total, 4) if total else 0.0,
            }
            for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {
                "name": k.name[:160],
                "kind": k.kind,
                "calls": k.calls,
                "ms_per_step": round(k.us / 1000 / max(steps, 1), 3),
            }
            for k in sorted(kernels, key=lambda k: -k.us)[:30]
        ],
    }


def format_summary(summary: dict[str, Any]) -> str:
    what = "GPU kernel time" if summary["device"] == "cuda" else "operator self time (CPU)"
    lines = [
        f"{summary['steps']} step(s), {summary['per_step_ms']:.1f} ms per step (profiler on); {what} by kind:",
    ]
    if summary["busy_share"] is not None and summary["device"] == "cuda":
        lines.append(
            f"GPU busy {100 * summary['busy_share']:.1f}% of the window (union of compute kernels; "
            "the rest is time the GPU waited for the host or for communication)"
        )
    lines.append(f"{'kind':<24}{'ms/step':>10}{'share':>8}")
    for kind, v in summary["kinds"].items():
        lines.append(f"{kind:<24}{v['ms_per_step']:>10.2f}{100 * v['share']:>7.1f}%")
    lines += ["", f"{'ms/step':>9} {'calls':>6}  {'kind':<22} kernel"]
    for k in summary["top"]:
        lines.append(f"{k['ms_per_step']:>9.2f} {k['calls']:>6}  {k['kind']:<22} {k['name'][:110]}")
    return "\n".join(lines) + "\n"


class StepProfiler:
    """Starts torch.profiler before step FIRST, stops after step LAST, writes the summary."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device) -> None:
        self.steps = steps
        self.out_dir = out_dir
        self.rank = rank
        self.device = device
        self._prof: Any = None
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        """`step` is the 1-based number of the step about to run."""
        if self.steps is None or step != self.steps[0] or self._prof is not None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> Path | None:
        """After step `step`: once the last profiled step is done, the summary written (else None)."""
        if self._prof is None or self.steps is None or step < self.steps[1]:
            return None
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        window_us = (time.perf_counter() - self._t0) * 1e6
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        steps = self.steps[1] - self.steps[0] + 1
        kernels, busy_us = _kernel_times(prof, self.device.type == "cuda")
        summary = summarise(kernels, window_us, steps, self.device.type, busy_us)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank-{self.rank}"
        Path(f"{stem}.json").write_text(json.dumps(summary, indent=1))
        Path(f"{stem}.txt").write_text(format_summary(summary))
        prof.export_chrome_trace(f"{stem}.trace.json.gz")
        return Path(f"{stem}.txt")


def _kernel_times(prof: Any, cuda: bool) -> tuple[list[KernelTime], float]:
    """Per kernel (CUDA) or operator (CPU): calls and time; and the device's busy time (CUDA).

    Ranges that only annotate (`Optimizer.step#...`, `ProfilerStep#`, record_function ranges shown on
    the GPU timeline) are left out: they cover kernels that are already counted.
    """
    if not cuda:
        out = [
            KernelTime(evt.key, kind_of(evt.key), int(evt.count), float(evt.self_cpu_time_total))
            for evt in prof.key_averages()
            if evt.self_cpu_time_total > 0
        ]
        return out, 0.0
    totals: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        if (
            getattr(evt, "is_user_annotation", False)
            or "#" in evt.name
            or evt.name.startswith("ProfilerStep")
        ):
            continue
        start, end = float(evt.time_range.start), float(evt.time_range.end)
        entry = totals.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        if kind_of(evt.name) != "communication":
            spans.append((start, end))
    return [KernelTime(name, kind_of(name), int(n), us) for name, (n, us) in totals.items()], _union(spans)


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: kernels on several streams overlap, busy time must not double."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy
