"""What rank 0's reports cost the training loop: per step, per logging interval, and rich's thread.

    PYTHONPATH=. python scripts/progress_bench.py [STEPS]      (STEPS default 20000)

For each progress mode (quiet, lines, bar; the bar draws to /dev/null as if on a terminal) it
times `TrainingLog.step` (what the loop calls after every step: the interval's sums, the step
event, the bar's count) on a CPU tensor, and `TrainingLog.interval` (the progress line or bar
update, and TensorBoard's scalars with `--tensorboard`). Then it measures the CPU time of rich's
refresh thread while the bar stands still for 10 s (the bar's cost when steps are slow).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.progress import Progress, TrainingLog
from trainer.tracking import open_tracker


def timed_steps(mode: str, steps: int, tracker_dir: Path | None) -> tuple[float, float]:
    """(microseconds per step, milliseconds per interval)."""
    with open(os.devnull, "w") as sink:
        device = torch.device("cpu")
        progress = Progress(mode, steps, 8, device, stream=sink)
        tracker = open_tracker("tensorboard", tracker_dir, "bench", {}, 0, print) if tracker_dir else None
        log = TrainingLog(device, 8, 10**9, steps, 256, progress, tracker)
        result = SimpleNamespace(loss=torch.tensor(0.25), micro_batch=32, grad_accum=1)
        log.start(0)
        log.step(1, result, samples=32, step_time=0.1, data_wait=0.001, lr=1e-4)  # warm-up: first calls
        log.interval(1, 0.25, 1e-4, torch.tensor(1.0), 0)  # import and allocate
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            log.step(step, result, samples=32, step_time=0.1, data_wait=0.001, lr=1e-4)
        per_step = (time.perf_counter() - t0) / steps * 1e6
        intervals = 200
        t0 = time.perf_counter()
        for _ in range(intervals):
            log.interval(steps, 0.25, 1e-4, torch.tensor(1.0), 0)
        per_interval = (time.perf_counter() - t0) / intervals * 1e3
        log.close()
    return per_step, per_interval


def idle_bar_cpu(seconds: float = 10.0) -> float:
    """Percent of one core that rich's refresh thread uses while no step happens."""
    with open(os.devnull, "w") as sink:
        progress = Progress("bar", 1000, 8, torch.device("cpu"), stream=sink)
        progress.start(0)
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        used = (time.process_time() - cpu) / (time.perf_counter() - wall) * 100
        progress.close()
    return used


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    print(f"{'mode':<6} {'us/step':>8} {'ms/interval':>12} {'ms/interval +tensorboard':>25}")
    for mode in ("quiet", "lines", "bar"):
        per_step, per_interval = timed_steps(mode, steps, None)
        with tempfile.TemporaryDirectory() as tmp:
            _, with_tb = timed_steps(mode, steps, Path(tmp))
        print(f"{mode:<6} {per_step:>8.1f} {per_interval:>12.3f} {with_tb:>25.3f}")
    print(f"rich's refresh thread with the bar standing still: {idle_bar_cpu():.2f}% of a core")


if __name__ == "__main__":
    main()
