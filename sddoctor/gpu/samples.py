"""Plain records of what the data layer measured: GPUs, their processes, the host.

Units are the ones a script wants: bytes, bytes/s, watts, MHz, degrees C, percent.
`None` means "not measured here" (not supported by this GPU, not sampled yet, not readable),
never zero. `to_dict()` is the `--json` schema documented in docs/tui.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ProcessSample:
    """One process holding memory on one GPU (NVML), with its host-side view (psutil)."""

    pid: int
    gpu_index: int
    gpu_memory: int | None  # bytes; None where NVML hides it (no permission, MIG)
    user: str | None = None
    cpu_percent: float | None = None
    rss: int | None = None
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuSample:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    utilization_gpu: float | None = None
    utilization_mem: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None
    power_draw: float | None = None
    power_limit: float | None = None
    clock_sm: int | None = None
    clock_mem: int | None = None
    pstate: int | None = None
    clock_event_reasons: list[str] = field(default_factory=list)
    clock_event_mask: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    pcie_rx: float | None = None  # bytes/s, from the background PCIe sampler
    pcie_tx: float | None = None
    processes: list[ProcessSample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # reads that failed for a reason worth showing

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["processes"] = [p.to_dict() for p in self.processes]
        return data


@dataclass
class HostSample:
    hostname: str
    cpu_percent: float | None
    cpu_count: int | None
    memory_used: int | None
    memory_total: int | None
    load_average: tuple[float, float, float] | None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["load_average"] = list(self.load_average) if self.load_average else None
        return data


@dataclass
class GpuSnapshot:
    """One sampling round of the local machine."""

    t: float
    host: HostSample
    gpus: list[GpuSample]
    nvml_available: bool
    nvml_note: str | None = None  # why NVML is unavailable, in words a user can act on
    driver_version: str | None = None
    sample_seconds: float | None = None  # wall time the round took (cost)

    def process(self, pid: int) -> list[ProcessSample]:
        return [p for g in self.gpus for p in g.processes if p.pid == pid]
