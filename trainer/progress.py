"""Step telemetry without host syncs, and rank 0's progress line.

`StepReporter` hands every optimizer step to `sdi.step` exactly once, in order. On CUDA the loss
of a step is copied to pinned host memory without waiting; the step is reported once that copy
has landed (usually a step or two later), so the training loop never blocks on the GPU to
report a loss. `flush()` waits for everything (used at logging intervals, which sync anyway).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import torch

from sddoctor.instrument import api as sdi


class StepReporter:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: collections.deque[tuple[int, torch.Tensor, Any, dict[str, Any]]] = collections.deque()

    def push(self, step: int, loss: torch.Tensor, **fields: Any) -> None:
        if not self.cuda:
            sdi.step(step, loss=float(loss), **fields)
            return
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(loss.detach().float(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, host, event, fields))
        self._drain(wait=False)

    def flush(self) -> None:
        self._drain(wait=True)

    def _drain(self, wait: bool) -> None:
        while self._pending:
            step, host, event, fields = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.popleft()
            sdi.step(step, loss=float(host), **fields)


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(current, peak) GiB: CUDA allocator on GPU, resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30, torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import psutil

        rss = psutil.Process(os.getpid()).memory_info().rss / 2**30
    except Exception:
        rss = 0.0
    return rss, rss


def memory_bytes(device: torch.device) -> tuple[int | None, int | None]:
    """(allocated, peak) bytes for step events; host-side counters, no sync. None on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return None, None


class ProgressLine:
    """Rank 0's line every logging interval: bar, step, loss, it/s, images/s, memory, lr."""

    def __init__(self, total_steps: int, world_size: int, device: torch.device, stream=None) -> None:
        self.total = total_steps
        self.world_size = world_size
        self.device = device
        self.stream = stream or sys.stdout
        self._last_time = time.perf_counter()
        self._last_step: int | None = None

    def reset(self, step: int) -> None:
        self._last_time = time.perf_counter()
        self._last_step = step

    def show(self, step: int, loss: float, images_per_step: int, lr: float) -> dict[str, float]:
        now = time.perf_counter()
        steps = step - (self._last_step if self._last_step is not None else 0)
        elapsed = max(now - self._last_time, 1e-9)
        it_s = steps / elapsed
        images_s = it_s * images_per_step
        mem, peak = memory_gib(self.device)
        width = 20
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        mem_label = "mem" if self.device.type == "cuda" else "rss"
        print(
            f"[{bar}] step {step}/{self.total} | loss {loss:.4f} | {it_s:.2f} it/s | "
            f"{images_s:.1f} img/s ({images_s / self.world_size:.1f}/rank) | "
            f"{mem_label} {mem:.2f} GiB (peak {peak:.2f}) | lr {lr:.2e}",
            file=self.stream,
            flush=True,
        )
        self._last_time, self._last_step = now, step
        return {"it_s": it_s, "images_s": images_s}
