"""Where a training step's time goes: torch.profiler over a few steps, summed by kernel kind.

    --set train.profile_steps=11-13      record steps 11 to 13 (1-based, inclusive)

Each rank writes, under OUTPUT_DIR/profile/:
- `rank-N.txt`: the share of device time per kind of work (convolution, matmul, attention,
  normalisation, elementwise, optimizer, copies and layout changes, communication), how busy the
  device was over the recorded window, where the GPU sat idle between kernels and what the host
  was doing meanwhile (CUDA), and the 30 most expensive kernels;
- `rank-N.json`: the same figures for scripts;
- `rank-N.trace.json.gz`: the full trace, for chrome://tracing or Perfetto.

On CUDA the figures are GPU kernel times; on a CPU, the self time of each operator. The profiled
steps run slower than the others (the profiler records every kernel launch), so a throughput
measurement should not include them.
"""

from __future__ import annotations

import contextlib
import heapq
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
    kernels: list[KernelTime],
    window_us: float,
    steps: int,
    device: str,
    busy_us: float = 0.0,
    idle: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Shares per kind, device busy time over the window (`busy_us`: union of compute kernels), the
    GPU's idle gaps (`idle`, from `idle_gaps`), the costliest kernels."""
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
        "idle": idle,
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
    idle = summary.get("idle")
    if idle:
        lines += [
            "",
            f"GPU idle between its first and last kernel: {idle['ms_per_step']:.2f} ms per step, "
            f"{idle['short_ms_per_step']:.2f} of it in gaps under {idle['min_gap_ms']} ms (launch latency); "
            "longer gaps by what the host was doing at their middle:",
            f"{'ms/step':>9} {'gaps':>6}  host",
        ]
        for row in idle["by_host"]:
            lines.append(f"{row['ms_per_step']:>9.2f} {row['gaps']:>6}  {row['host'][:120]}")
        lines += ["", "largest gaps:", f"{'at ms':>9} {'ms':>7}  host / next kernel"]
        for gap in idle["largest"]:
            lines.append(
                f"{gap['at_ms']:>9.2f} {gap['ms']:>7.2f}  {gap['host'][:90]} / {gap['next_kernel'][:60]}"
            )
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

    def range(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A named range on the host timeline while recording, so idle gaps name the loop's part."""
        if self._prof is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

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
        kernels, busy_us, idle = _kernel_times(prof, self.device.type == "cuda", steps)
        summary = summarise(kernels, window_us, steps, self.device.type, busy_us, idle)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank-{self.rank}"
        Path(f"{stem}.json").write_text(json.dumps(summary, indent=1))
        Path(f"{stem}.txt").write_text(format_summary(summary))
        prof.export_chrome_trace(f"{stem}.trace.json.gz")
        return Path(f"{stem}.txt")


@dataclass
class HostOp:
    """An operator or record_function range on one host thread (profiler times, microseconds)."""

    name: str
    start: float
    end: float
    thread: int


def host_stacks(times: list[float], ops: list[HostOp]) -> list[list[HostOp]]:
    """For each time, the host ops running at it, outermost first, on the thread nested deepest.

    One sweep over the ops sorted by start with a heap of the open ones, so a long window of
    tens of thousands of operators costs milliseconds, not a scan per question.
    """
    ordered = sorted(ops, key=lambda op: (op.start, -op.end))
    order = sorted(range(len(times)), key=lambda i: times[i])
    open_ops: list[tuple[float, int]] = []
    stacks: list[list[HostOp]] = [[] for _ in times]
    next_op = 0
    for i in order:
        t = times[i]
        while next_op < len(ordered) and ordered[next_op].start <= t:
            heapq.heappush(open_ops, (ordered[next_op].end, next_op))
            next_op += 1
        while open_ops and open_ops[0][0] < t:
            heapq.heappop(open_ops)
        by_thread: dict[int, list[int]] = {}
        for _, index in open_ops:
            by_thread.setdefault(ordered[index].thread, []).append(index)
        if by_thread:
            deepest = max(by_thread.values(), key=len)
            stacks[i] = [ordered[index] for index in sorted(deepest)]
    return stacks


def host_label(stack: list[HostOp], depth: int = 3) -> str:
    if not stack:
        return "(no operator: Python code, or the host waiting outside torch)"
    return " > ".join(op.name for op in stack[:depth])


def idle_gaps(
    spans: list[tuple[float, float, str]],
    host_ops: list[HostOp],
    steps: int,
    min_gap_us: float = 100.0,
    largest: int = 12,
) -> dict[str, Any] | None:
    """Where the GPU waited between its first and last kernel, and what the host did meanwhile.

    `spans` are (start, end, kernel name). Gaps shorter than `min_gap_us` are the launch latency
    between back-to-back kernels and are only totalled; each longer gap is put down to the host
    stack at its middle, which names the cause: a sync (`aten::item`), the data loader, Python
    between operators, an optimizer that launches too many small kernels.
    """
    if not spans:
        return None
    ordered = sorted(spans)
    gaps: list[tuple[float, float, str]] = []
    reach = ordered[0][1]
    for start, end, name in ordered[1:]:
        if start > reach:
            gaps.append((reach, start, name))
        reach = max(reach, end)
    long_gaps = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    stacks = host_stacks([(a + b) / 2 for a, b, _ in long_gaps], host_ops)
    by_host: dict[str, list[float]] = {}
    for (a, b, _), stack in zip(long_gaps, stacks, strict=True):
        row = by_host.setdefault(host_label(stack), [0, 0.0])
        row[0] += 1
        row[1] += b - a
    per_step = max(steps, 1) * 1000.0
    first = ordered[0][0]
    longest_first = sorted(
        zip(long_gaps, stacks, strict=True), key=lambda gs: gs[0][1] - gs[0][0], reverse=True
    )
    biggest = longest_first[:largest]
    return {
        "min_gap_ms": min_gap_us / 1000,
        "ms_per_step": round(sum(b - a for a, b, _ in gaps) / per_step, 3),
        "short_ms_per_step": round(sum(b - a for a, b, _ in gaps if b - a < min_gap_us) / per_step, 3),
        "by_host": [
            {"host": host, "gaps": int(n), "ms_per_step": round(us / per_step, 3)}
            for host, (n, us) in sorted(by_host.items(), key=lambda kv: -kv[1][1])
        ],
        "largest": [
            {
                "at_ms": round((a - first) / 1000, 3),
                "ms": round((b - a) / 1000, 3),
                "host": host_label(stack, depth=4),
                "next_kernel": name[:160],
            }
            for (a, b, name), stack in biggest
        ],
    }


def _kernel_times(prof: Any, cuda: bool, steps: int) -> tuple[list[KernelTime], float, dict[str, Any] | None]:
    """Per kernel (CUDA) or operator (CPU): calls and time; the device's busy time and idle gaps (CUDA).

    Ranges that only annotate (`Optimizer.step#...`, `ProfilerStep#`, record_function ranges shown on
    the GPU timeline) are left out of the kernels: they cover kernels that are already counted. On
    the host side they are kept: they say what the host was doing during a gap.
    """
    if not cuda:
        out = [
            KernelTime(evt.key, kind_of(evt.key), int(evt.count), float(evt.self_cpu_time_total))
            for evt in prof.key_averages()
            # ranges (the trainer's own, `Optimizer.step#...`) are not operators: their self time is
            # the Python between operators
            if evt.self_cpu_time_total > 0 and not getattr(evt, "is_user_annotation", False)
        ]
        return out, 0.0, None
    totals: dict[str, list[float]] = {}
    spans: list[tuple[float, float, str]] = []
    host_ops: list[HostOp] = []
    for evt in prof.events():
        start, end = float(evt.time_range.start), float(evt.time_range.end)
        if str(getattr(evt, "device_type", "")).split(".")[-1] != "CUDA":
            if not evt.name.startswith("ProfilerStep"):
                host_ops.append(HostOp(evt.name, start, end, int(getattr(evt, "thread", 0))))
            continue
        if (
            getattr(evt, "is_user_annotation", False)
            or "#" in evt.name
            or evt.name.startswith("ProfilerStep")
        ):
            continue
        entry = totals.setdefault(evt.name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        if kind_of(evt.name) != "communication":
            spans.append((start, end, evt.name))
    kernels = [KernelTime(name, kind_of(name), int(n), us) for name, (n, us) in totals.items()]
    busy = _union([(a, b) for a, b, _ in spans])
    return kernels, busy, idle_gaps(spans, host_ops, steps)


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: kernels on several streams overlap, busy time must not double."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy
