"""A stand-in for the pynvml module, installed with `set_nvml_for_tests(FakeNvml(...))`.

It fakes NVML at the edge so that `NvmlSource` itself runs in tests and on machines without a
GPU (the benchmark uses it to measure our own overhead). Values are fixed or cycle through
given series, one step per utilization read, so screens built from it are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    memory_total: int = 143771 << 20
    memory_used: int = 1 << 30
    util_series: list[int] = field(default_factory=lambda: [0])
    mem_util: int = 0
    temperature: int = 35
    power_mw: int = 75_000
    power_limit_mw: int = 700_000
    clock_sm: int = 1980
    clock_mem: int = 3201
    pstate: int = 0
    clock_events: int = 0x1
    ecc: tuple[int, int] | None = (0, 0)  # None: ECC not supported
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    pcie_kb: tuple[int, int] | None = (1200, 800)  # (rx, tx) KB/s; None: not supported
    bus_id: str | None = None
    uuid: str | None = None
    _reads: int = 0


class FakeNvml:
    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[FakeGpu], driver: str = "570.00") -> None:
        self.gpus = gpus
        self.driver = driver
        self.calls: dict[str, int] = {}
        for i, g in enumerate(gpus):
            g.bus_id = g.bus_id or f"00000000:{0x18 + 0x10 * i:02X}:00.0"
            g.uuid = g.uuid or f"GPU-{i:08x}-0000-0000-0000-000000000000"

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: Any) -> FakeGpu:
        return self.gpus[handle]

    def nvmlInit(self) -> None:
        self._count("init")

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._count("handle")
        return index

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._gpu(h).uuid or ""

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._gpu(h).bus_id)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._count("utilization")
        g = self._gpu(h)
        value = g.util_series[g._reads % len(g.util_series)]
        g._reads += 1
        return SimpleNamespace(gpu=value, memory=g.mem_util)

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        g = self._gpu(h)
        return SimpleNamespace(total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._gpu(h).temperature

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._gpu(h).power_limit_mw

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        g = self._gpu(h)
        return g.clock_sm if clock == self.NVML_CLOCK_SM else g.clock_mem

    def nvmlDeviceGetPerformanceState(self, h: int) -> int:
        return self._gpu(h).pstate

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu(h).clock_events

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        self._count("ecc")
        ecc = self._gpu(h).ecc
        if ecc is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return ecc[error_type]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self._gpu(h).processes]

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self._count("pcie")
        kb = self._gpu(h).pcie_kb
        if kb is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return kb[0] if counter == self.NVML_PCIE_UTIL_RX_BYTES else kb[1]


def demo_gpus(n: int = 2, processes: list[list[tuple[int, int | None]]] | None = None) -> list[FakeGpu]:
    """`n` busy H200-like GPUs with varied, fixed readings (used by tests, docs screenshots, bench)."""
    gpus = []
    for i in range(n):
        gpus.append(
            FakeGpu(
                memory_used=_used(
                    processes[i] if processes and i < len(processes) else [], (40 + 7 * i) << 30
                ),
                util_series=[(37 * k + 11 * i) % 101 for k in range(1, 41)],
                mem_util=30 + 5 * i,
                temperature=48 + 3 * i,
                power_mw=420_000 + 31_000 * i,
                clock_sm=1980 - 45 * (i % 3),
                clock_events=0x004 if i == 1 else 0x0,
                ecc=(0, 0) if i % 2 == 0 else None,
                processes=(processes[i] if processes and i < len(processes) else []),
            )
        )
    return gpus


def _used(processes: list[tuple[int, int | None]], default: int) -> int:
    """Memory in use: what the processes hold plus a context's worth, or `default` without any."""
    held = sum(mem or 0 for _, mem in processes)
    return held + (512 << 20) if held else default
