"""What the training loop reports, and to whom, without adding host syncs to a step.

Every step goes to sddoctor's telemetry (`StepReporter`): on CUDA the loss of a step is copied
to pinned host memory without waiting, and the step is reported once that copy has landed
(usually a step or two later), so the loop never blocks on the GPU to report a loss. `flush()`
waits for everything (used at logging intervals, which sync anyway).

Every logging interval (`train.log_every`), after the loop's one host sync, rank 0 shows the
interval on its progress (`Progress`: a live bar on a terminal, a line otherwise, nothing with
--quiet) and writes it to the tracker (trainer/tracking.py). `TrainingLog` is the loop's one
seam for all of it.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from sddoctor.instrument import api as sdi
from trainer.tracking import Tracker


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
    allocated, peak = memory_bytes(device)
    if allocated is not None and peak is not None:
        return allocated / 2**30, peak / 2**30
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


@dataclass
class Interval:
    """One logging interval as rank 0 reports it (host numbers; rates over the interval's wall time)."""

    step: int
    loss: float
    """Mean loss over the interval's steps and all ranks."""
    lr: float
    it_s: float
    images_s: float
    """Images per second of all ranks together (the global rate)."""
    images_s_per_rank: float
    """images_s / world size: per GPU on CUDA, per process on a CPU."""
    step_time: float
    """Mean host seconds per step (data + step)."""
    data_wait: float
    """Mean host seconds per step spent waiting for the data loader."""
    mem: float
    """GiB: CUDA allocator's current bytes, or the process's resident set on a CPU."""
    mem_peak: float
    elapsed: float
    """Seconds since the loop started."""
    remaining: float | None
    """Seconds to the last step at the interval's rate (None before a rate exists)."""
    grad_norm: float | None
    """Mean finite gradient norm over the interval (None: no finite one)."""
    oom_fallbacks: int
    micro_batch: int
    grad_accum: int

    def scalars(self) -> dict[str, float]:
        """The tracker's tags (TensorBoard groups them by the part before the slash)."""
        values = {
            "train/loss": self.loss,
            "train/lr": self.lr,
            "perf/images_per_s": self.images_s,
            "perf/images_per_s_per_gpu": self.images_s_per_rank,
            "perf/it_per_s": self.it_s,
            "perf/step_time_s": self.step_time,
            "perf/data_wait_s": self.data_wait,
            "memory/current_gib": self.mem,
            "memory/peak_gib": self.mem_peak,
            "oom/fallbacks": float(self.oom_fallbacks),
            "oom/micro_batch": float(self.micro_batch),
        }
        if self.grad_norm is not None:
            values["train/grad_norm"] = self.grad_norm
        return values


def clock(seconds: float | None) -> str:
    """H:MM:SS (M:SS under an hour); -:-- when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Rank 0's progress: `bar` (rich, live, redrawn 4 times a second by rich's own thread), `lines`
    (one per logging interval, the time left at that interval's pace) or `quiet`; `auto` is the
    bar on a terminal, lines otherwise."""

    def __init__(
        self, mode: str, total_steps: int, world_size: int, device: torch.device, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if _is_terminal(self.stream) else "lines"
        self.mode = mode
        self.total = total_steps
        self.world_size = world_size
        self.per = "GPU" if device.type == "cuda" else "rank"
        self.mem_label = "mem" if device.type == "cuda" else "rss"
        self._bar: Any = None
        self._task: Any = None

    def start(self, step: int) -> None:
        if self.mode != "bar":
            return
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(
            _bar_column(),
            console=Console(file=self.stream, force_terminal=True),
            refresh_per_second=4,
            speed_estimate_period=60,  # the time left follows the last minute's pace
        )
        self._task = self._bar.add_task("train", total=self.total, completed=step, stats="")
        self._bar.start()  # print() and warnings now appear above the bar

    def advance(self, step: int) -> None:
        """After every step: the bar's count (a lock and a clock read, no GPU)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def show(self, interval: Interval) -> None:
        iv = interval
        stats = (
            f"loss {iv.loss:.4f} | {iv.images_s:.1f} img/s all ranks ({iv.images_s_per_rank:.1f}/{self.per}) | "
            f"{self.mem_label} {iv.mem:.2f} GiB (peak {iv.mem_peak:.2f}) | lr {iv.lr:.2e}"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=iv.step, stats=stats)
        elif self.mode == "lines":
            width = 20
            filled = int(width * iv.step / max(1, self.total))
            bar = "#" * filled + "-" * (width - filled)
            print(
                f"[{bar}] step {iv.step}/{self.total} | {iv.it_s:.2f} it/s | {stats} | "
                f"{clock(iv.elapsed)} elapsed, {clock(iv.remaining)} left",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        """Stop the bar, leaving its last state on screen."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _bar_column() -> Any:
    """Rich's bar as two lines, each cut at the terminal's edge (never wrapped, so that a narrow
    terminal keeps a steady display): the step, the bar, elapsed and remaining time (rich's
    estimate from the per-step pace); the latest logging interval's numbers."""
    from rich.progress import ProgressColumn
    from rich.table import Column
    from rich.text import Text

    class BarLines(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = task.total or 1
            filled = int(20 * task.completed / total)
            text = Text.assemble(
                f"step {int(task.completed)}/{int(total)} ",
                ("━" * filled, "bar.complete"),
                ("━" * (20 - filled), "bar.back"),
                f" {100 * task.completed / total:.0f}% | {clock(task.elapsed)} elapsed, "
                f"{clock(task.time_remaining)} left",
            )
            if task.fields["stats"]:
                text.append("\n" + task.fields["stats"])
            return text

    return BarLines(table_column=Column(no_wrap=True, overflow="ellipsis"))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class TrainingLog:
    """The loop's reports: each step to telemetry, each logging interval to rank 0's progress and
    tracker. The interval's sums stay on the device (loss) or the host (times) until it ends."""

    def __init__(
        self,
        device: torch.device,
        world_size: int,
        log_every: int,
        total_steps: int,
        images_per_step: int,
        progress: Progress | None,
        tracker: Tracker | None,
    ) -> None:
        self.device = device
        self.world_size = world_size
        self.log_every = log_every
        self.total_steps = total_steps
        self.images_per_step = images_per_step
        self.progress = progress
        self.tracker = tracker
        self.reporter = StepReporter(device)
        self._loss_sum = torch.zeros((), device=device)
        self._steps = 0
        self._step_time = 0.0
        self._data_wait = 0.0
        self._shape = (0, 0)  # (micro_batch, grad_accum) of the latest step
        self._start = self._last_time = time.perf_counter()
        self._last_step = 0

    def start(self, step: int) -> None:
        """The loop begins at `step` (0, or where a checkpoint left off)."""
        if self.device.type == "cuda":  # step events report the training peak, not the setup's (cache build)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = self._last_time = time.perf_counter()
        self._last_step = step
        if self.progress is not None:
            self.progress.start(step)

    def step(
        self, step: int, result: Any, samples: int, step_time: float, data_wait: float, lr: float
    ) -> None:
        """After every optimizer step: its telemetry event, the interval's sums, the bar's count."""
        self._loss_sum += result.loss
        self._steps += 1
        self._step_time += step_time
        self._data_wait += data_wait
        self._shape = (result.micro_batch, result.grad_accum)
        mem_alloc, mem_peak = memory_bytes(self.device)
        self.reporter.push(
            step,
            result.loss,
            samples=samples,
            step_time=step_time,
            micro_batch=result.micro_batch,
            grad_accum=result.grad_accum,
            mem_alloc=mem_alloc,
            mem_peak=mem_peak,
            lr=lr,
            images_per_s=self.images_per_step / step_time if step_time > 0 else None,
            data_wait=data_wait,
            t_end=time.time(),  # on CUDA the event itself is written once the GPU is done
        )
        if self.progress is not None:
            self.progress.advance(step)

    def due(self, step: int) -> bool:
        """Whether `step` ends a logging interval."""
        return step % self.log_every == 0 or step == self.total_steps

    def flush(self) -> None:
        """Report every step still waiting for its loss (waits for the GPU)."""
        self.reporter.flush()

    def window_loss(self) -> torch.Tensor:
        """This rank's mean loss over the interval, on the device (the loop all-reduces it)."""
        return self._loss_sum / self._steps

    def interval(
        self, step: int, loss: float, lr: float, grad_norm: torch.Tensor, oom_fallbacks: int
    ) -> Interval:
        """End the interval (every rank); rank 0 shows it and writes it to the tracker. `grad_norm`
        is read (a device-to-host copy, after the interval's sync) only where it is reported."""
        now = time.perf_counter()
        reporting = self.progress is not None or self.tracker is not None
        norm = float(grad_norm) if reporting else math.nan
        it_s = (step - self._last_step) / max(now - self._last_time, 1e-9)
        images_s = it_s * self.images_per_step
        mem, mem_peak = memory_gib(self.device)
        interval = Interval(
            step=step,
            loss=loss,
            lr=lr,
            it_s=it_s,
            images_s=images_s,
            images_s_per_rank=images_s / self.world_size,
            step_time=self._step_time / max(1, self._steps),
            data_wait=self._data_wait / max(1, self._steps),
            mem=mem,
            mem_peak=mem_peak,
            elapsed=now - self._start,
            remaining=(self.total_steps - step) / it_s if it_s > 0 else None,
            grad_norm=norm if math.isfinite(norm) else None,
            oom_fallbacks=oom_fallbacks,
            micro_batch=self._shape[0],
            grad_accum=self._shape[1],
        )
        if self.progress is not None:
            self.progress.show(interval)
        if self.tracker is not None:
            self.tracker.scalars(interval.scalars(), step)
        self._loss_sum.zero_()
        self._steps = 0
        self._step_time = self._data_wait = 0.0
        self._last_time, self._last_step = now, step
        return interval

    def image(self, tag: str, image: Any, step: int) -> None:
        if self.tracker is not None:
            self.tracker.image(tag, image, step)

    def close(self) -> None:
        """Stop the bar and close the tracker (also after a failure)."""
        if self.progress is not None:
            self.progress.close()
        if self.tracker is not None:
            self.tracker.close()
