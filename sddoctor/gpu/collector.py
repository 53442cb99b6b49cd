"""One sampling round of the local machine: GPUs (a `GpuSource`) + host (a `HostSampler`),
plus a short history of each GPU's utilization, memory and power for sparklines."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from sddoctor.gpu.host import HostSampler, PsutilHost
from sddoctor.gpu.samples import GpuSnapshot
from sddoctor.gpu.source import GpuSource, NvmlSource

HISTORY_LENGTH = 120


class History:
    """Last `length` values of each series, keyed by (gpu index, metric)."""

    def __init__(self, length: int = HISTORY_LENGTH) -> None:
        self.length = length
        self._series: dict[tuple[int, str], collections.deque[float]] = {}

    def add(self, gpu: int, metric: str, value: float | None) -> None:
        series = self._series.get((gpu, metric))
        if series is None:
            series = self._series[(gpu, metric)] = collections.deque(maxlen=self.length)
        series.append(0.0 if value is None else float(value))

    def get(self, gpu: int, metric: str) -> list[float]:
        return list(self._series.get((gpu, metric), ()))


class Collector:
    def __init__(
        self,
        source: GpuSource | None = None,
        host: HostSampler | None = None,
        clock: Callable[[], float] = time.time,
        history_length: int = HISTORY_LENGTH,
    ) -> None:
        self.source: GpuSource = source if source is not None else NvmlSource()
        self.host: HostSampler = host if host is not None else PsutilHost()
        self.clock = clock
        self.history = History(history_length)
        self.samples = 0
        self.last: GpuSnapshot | None = None

    def sample(self) -> GpuSnapshot:
        t0 = time.perf_counter()
        gpus = self.source.sample()
        pids = sorted({p.pid for g in gpus for p in g.processes})
        info = self.host.processes(pids)
        for g in gpus:
            for p in g.processes:
                i = info.get(p.pid)
                if i is not None:
                    p.user, p.cpu_percent, p.rss, p.command = i.user, i.cpu_percent, i.rss, i.command
            self.history.add(g.index, "util", g.utilization_gpu)
            self.history.add(g.index, "mem", g.memory_percent)
            self.history.add(g.index, "power", g.power_draw)
        snap = GpuSnapshot(
            t=self.clock(),
            host=self.host.host(),
            gpus=gpus,
            nvml_available=self.source.available,
            nvml_note=self.source.note,
            driver_version=self.source.driver_version,
        )
        snap.sample_seconds = time.perf_counter() - t0
        self.samples += 1
        self.last = snap
        return snap

    def close(self) -> None:
        self.source.close()
