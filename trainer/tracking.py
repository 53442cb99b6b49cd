"""Where rank 0's training curves and sample grids go: TensorBoard, Weights & Biases, or nowhere.

    output.report_to = tensorboard   OUTPUT_DIR/tensorboard/ (`tensorboard --logdir OUTPUT_DIR/tensorboard`)
                       wandb         a wandb run in OUTPUT_DIR/wandb/ (WANDB_MODE=offline: no network;
                                     `wandb sync` uploads it later)
                       all           both
                       none          neither (sddoctor's telemetry is written either way)

Rank 0 writes at the logging intervals (numbers the loop already has on the host) and after each
sample grid, so tracking adds no host sync to a step. Every rank checks before anything is built
that the chosen packages are installed (a clear exit 2 instead of a failure after set-up). A
tracker that fails later (disk full, wandb's service gone) says so once and stops; the training
goes on.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: output.report_to -> the backends it writes to
BACKENDS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "all": ("tensorboard", "wandb"), "none": ()}
#: backend -> (module to find, how to install it)
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}


class TrackerUnavailable(ValueError):
    """The package a chosen tracker needs is not installed (bad input: exit code 2)."""


def check_available(report_to: str) -> None:
    """Raise TrackerUnavailable naming the package and the fix (looks the package up, no import)."""
    for backend in BACKENDS[report_to]:
        module, install = PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise TrackerUnavailable(
                f"output.report_to={report_to} needs the {module} package, which is not installed: "
                f"{install}, or choose another with --report-to tensorboard|wandb|none"
            )


class Tracker:
    """Scalars and images to every open backend; a backend that fails is closed with one warning."""

    def __init__(self, backends: list[Any], warn: Callable[[str], None]) -> None:
        self.backends = backends
        self.warn = warn

    def scalars(self, values: dict[str, float], step: int) -> None:
        self._each("scalars", values, step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        self._each("image", tag, image, step)

    def close(self) -> None:
        for backend in self.backends:
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001 - closing must not hide the run's own outcome
                self.warn(f"{backend.name}: closing failed ({type(exc).__name__}: {exc})")
        self.backends = []

    def _each(self, method: str, *args: Any) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops a training run
                self.warn(f"{backend.name}: stopped writing ({type(exc).__name__}: {exc}); training goes on")
                self.backends.remove(backend)
                try:
                    backend.close()
                except Exception:  # noqa: BLE001, S110 - already reported
                    pass


def open_tracker(
    report_to: str,
    out_dir: Path,
    run_name: str,
    config: dict[str, Any],
    start_step: int,
    warn: Callable[[str], None],
) -> Tracker:
    """Rank 0's tracker. `start_step` > 0 (a resumed run): TensorBoard hides the earlier run's
    events after that step, so that the curves do not double back."""
    backends: list[Any] = []
    for name in BACKENDS[report_to]:
        try:
            if name == "tensorboard":
                backends.append(TensorBoard(out_dir / "tensorboard", start_step))
            else:
                backends.append(Wandb(out_dir, run_name, config))
        except Exception as exc:  # noqa: BLE001 - no tracker is worth a failed run
            hint = " (log in with `wandb login`, or set WANDB_MODE=offline)" if name == "wandb" else ""
            warn(f"{name}: could not start ({type(exc).__name__}: {exc}){hint}; training goes on without it")
    return Tracker(backends, warn)


class TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the earlier run's events after the step this one resumes
        # from (this run logs them again). flush_secs: a curve someone watches is at most 30 s
        # behind (the default is 2 minutes).
        purge_step = start_step + 1 if start_step else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()  # sample grids are rare and worth seeing at once

    def close(self) -> None:
        self.writer.close()


class Wandb:
    name = "wandb"

    def __init__(self, out_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        out_dir.mkdir(parents=True, exist_ok=True)
        # WANDB_MODE, WANDB_PROJECT and the rest of wandb's environment apply as usual. console="off":
        # wandb does not wrap stdout/stderr (the progress bar and sddoctor own the console).
        self.run = wandb.init(
            dir=str(out_dir),
            project=os.environ.get("WANDB_PROJECT", "sddoctor-trainer"),
            name=run_name,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image)}, step=step)

    def close(self) -> None:
        self.run.finish()
