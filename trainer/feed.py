"""The loop's supply of batches: epoch after epoch of the resumable sampler, prepared for the step.

The sampler's epoch and position are what a checkpoint saves (the loop advances the position
after each step), so a resumed run continues with the next unseen batch of the same epoch.
"""

from __future__ import annotations

import time
from typing import Any

from sddoctor.instrument import api as sdi
from trainer.data import ResumableDistributedSampler
from trainer.objective import DiffusionObjective
from trainer.step_profile import StepProfiler


class Batches:
    def __init__(
        self,
        loader: Any,
        sampler: ResumableDistributedSampler,
        objective: DiffusionObjective,
        profiler: StepProfiler,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self.objective = objective
        self.profiler = profiler
        self.epoch = sampler.epoch
        self._iter: Any = None

    def next(self) -> tuple[dict[str, Any], float]:
        """(the next prepared batch, host seconds spent waiting for the loader); a new epoch starts
        when one runs out."""
        while True:
            sdi.phase("data")
            wait_start = time.perf_counter()
            if self._iter is None:
                self.sampler.set_epoch(self.epoch)
                self._iter = iter(self.loader)
            with self.profiler.range("trainer: data"):
                try:
                    raw = next(self._iter)
                except StopIteration:
                    self.epoch += 1
                    self._iter = None
                    continue
                batch = self.objective.prepare(raw)
            return batch, time.perf_counter() - wait_start
