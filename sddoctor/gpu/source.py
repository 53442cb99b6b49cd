"""GPU sources: the `GpuSource` protocol and `NvmlSource`, which reads NVML through pynvml.

Cost per sample (measured on an H200): the per-GPU reads used here take 1-26 us each,
so a round over 8 GPUs stays under a millisecond of NVML time. PCIe throughput blocks for a
20 ms window per direction, so it never runs in `sample()`: a `PcieSampler` thread reads it
at a lower rate and `sample()` only copies its latest figures. Process utilization and total
energy (2-3 ms each) are not read at all. Handles and static facts (name, UUID, bus id) are
read once. A read that the GPU does not support is remembered and never retried, so
NotSupported costs one call, not one per sample.

Opening NVML (nvmlInit, device handles, static facts) takes 80-100 ms on an 8-GPU H200 host,
most of it inside the driver with the GIL released. `NvmlSource(open_in_background=True)` does
it on a thread so that `sddoctor tui` can import Textual meanwhile; everything that needs the
devices waits for the opening, which only the sampling thread does in the app.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sddoctor.gpu.nvml import NvmlUnavailable, as_str, nvml
from sddoctor.gpu.samples import GpuSample, ProcessSample
from sddoctor.gpu.throttle import decode_clock_events


class GpuSource(Protocol):
    """What the TUI and `--once` need from a GPU source."""

    @property
    def available(self) -> bool: ...

    @property
    def note(self) -> str | None:
        """Why GPUs cannot be read (None when they can)."""

    @property
    def driver_version(self) -> str | None: ...

    def sample(self) -> list[GpuSample]: ...

    def start_background(self) -> None:
        """Start slow readers (PCIe) in their own thread."""

    def close(self) -> None: ...


class NvmlSource:
    """Local GPUs through NVML. Never raises for a missing driver: `available` is False and
    `note` says why, so callers still show host and rank data."""

    def __init__(self, pcie_interval: float = 5.0, open_in_background: bool = False) -> None:
        self.pcie_interval = pcie_interval
        self._nv: Any = None
        self._note: str | None = None
        self._driver: str | None = None
        self._devices: list[_Device] = []
        self._pcie: PcieSampler | None = None
        self._closed = False
        self._pcie_lock = threading.Lock()  # start_background (sampling thread) vs close (UI thread)
        self._opened = threading.Event()
        if open_in_background:
            threading.Thread(target=self._open, name="sddoctor-nvml-open", daemon=True).start()
        else:
            self._open()

    def _open(self) -> None:
        try:
            self._nv = nvml()
            self._list_devices()
        except NvmlUnavailable as exc:
            self._nv, self._note = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken driver must not take the monitor down
            self._nv, self._devices, self._note = None, [], f"NVML failed while listing GPUs: {exc}"
        finally:
            self._opened.set()

    def wait_open(self) -> None:
        """Block until NVML is opened (or found unavailable); at once for a source opened in place."""
        self._opened.wait()

    def _list_devices(self) -> None:
        nv = self._nv
        try:
            self._driver = as_str(nv.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001
            self._driver = None
        count = nv.nvmlDeviceGetCount()
        for index in range(count):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            self._devices.append(_Device(nv, index, handle))
        if count == 0:
            self._note = "NVML works but reports no GPUs"

    @property
    def available(self) -> bool:
        self.wait_open()
        return bool(self._devices)

    @property
    def note(self) -> str | None:
        self.wait_open()
        return self._note

    @property
    def driver_version(self) -> str | None:
        self.wait_open()
        return self._driver

    @property
    def device_count(self) -> int:
        self.wait_open()
        return len(self._devices)

    def sample(self) -> list[GpuSample]:
        self.wait_open()
        sampler = self._pcie  # read once: close() on another thread may clear it
        pcie = sampler.latest() if sampler is not None else {}
        out = []
        for dev in self._devices:
            s = dev.sample()
            if dev.index in pcie:
                s.pcie_rx, s.pcie_tx = pcie[dev.index]
            out.append(s)
        return out

    def start_background(self) -> None:
        self.wait_open()
        with self._pcie_lock:
            if self._closed or not self._devices or self._pcie is not None or self.pcie_interval <= 0:
                return
            self._pcie = PcieSampler(
                self._nv, [(d.index, d.handle) for d in self._devices], self.pcie_interval
            )
            self._pcie.start()

    def close(self) -> None:
        with self._pcie_lock:
            self._closed = True
            pcie, self._pcie = self._pcie, None
        if pcie is not None:
            pcie.stop()


class _Device:
    """One GPU: its cached handle, static facts, and which reads it does not support."""

    def __init__(self, nv: Any, index: int, handle: Any) -> None:
        self.nv, self.index, self.handle = nv, index, handle
        self.unsupported: set[str] = set()
        self._memory_v2 = hasattr(nv, "nvmlMemory_v2")
        self.name = self._static(lambda: as_str(nv.nvmlDeviceGetName(handle)), "?")
        self.uuid = self._static(lambda: as_str(nv.nvmlDeviceGetUUID(handle)), "?")
        self.pci_bus_id = self._static(lambda: as_str(nv.nvmlDeviceGetPciInfo(handle).busId), "?")
        self._events_call = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )

    def _static(self, read: Callable[[], Any], default: Any) -> Any:
        try:
            return read()
        except Exception:  # noqa: BLE001
            return default

    def _read(self, key: str, read: Callable[[], Any], errors: list[str]) -> Any:
        """One NVML read; None when unsupported (remembered) or failed (reported once per sample)."""
        if key in self.unsupported:
            return None
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses
            if getattr(exc, "value", None) in (
                getattr(self.nv, "NVML_ERROR_NOT_SUPPORTED", 3),
                getattr(self.nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
            ):
                self.unsupported.add(key)
            else:
                errors.append(f"{key}: {exc}")
            return None

    def sample(self) -> GpuSample:
        nv, h = self.nv, self.handle
        errors: list[str] = []
        s = GpuSample(index=self.index, name=self.name, uuid=self.uuid, pci_bus_id=self.pci_bus_id)
        util = self._read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h), errors)
        if util is not None:
            s.utilization_gpu, s.utilization_mem = float(util.gpu), float(util.memory)
        mem = self._read("memory", self._memory, errors)
        if mem is not None:
            s.memory_used, s.memory_total = int(mem.used), int(mem.total)
        temp = self._read(
            "temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), errors
        )
        s.temperature = None if temp is None else float(temp)
        power = self._read("power", lambda: nv.nvmlDeviceGetPowerUsage(h), errors)
        s.power_draw = None if power is None else power / 1000.0
        limit = self._read("power_limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h), errors)
        s.power_limit = None if limit is None else limit / 1000.0
        s.clock_sm = self._read("clock_sm", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), errors)
        s.clock_mem = self._read("clock_mem", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM), errors)
        s.pstate = self._read("pstate", lambda: nv.nvmlDeviceGetPerformanceState(h), errors)
        events_call = self._events_call
        if events_call is not None:
            mask = self._read("clock_events", lambda: events_call(h), errors)
            if mask is not None:
                s.clock_event_mask = int(mask)
                s.clock_event_reasons = decode_clock_events(int(mask))
        s.ecc_corrected = self._read("ecc", lambda: self._ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED), errors)
        if s.ecc_corrected is not None:
            s.ecc_uncorrected = self._read(
                "ecc", lambda: self._ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED), errors
            )
        procs = self._read("processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h), errors) or []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            s.processes.append(ProcessSample(pid=int(p.pid), gpu_index=self.index, gpu_memory=used))
        s.errors = errors
        return s

    def _memory(self) -> Any:
        """Memory info v2 where the driver has it: its `used` leaves out memory the driver
        reserves, as nvidia-smi does; v1 counts reserved memory as used."""
        if self._memory_v2:
            try:
                return self.nv.nvmlDeviceGetMemoryInfo(self.handle, version=self.nv.nvmlMemory_v2)
            except Exception:  # noqa: BLE001 - old driver or bindings: fall back to v1 for good
                self._memory_v2 = False
        return self.nv.nvmlDeviceGetMemoryInfo(self.handle)

    def _ecc(self, error_type: int) -> int:
        return int(self.nv.nvmlDeviceGetTotalEccErrors(self.handle, error_type, self.nv.NVML_VOLATILE_ECC))


class PcieSampler:
    """Reads PCIe rx/tx throughput of every GPU in a daemon thread, every `interval` seconds.

    Each read blocks about 20 ms inside NVML (it measures a window), 2 per GPU per round,
    which is why it lives here and not in `NvmlSource.sample()` or on a UI thread.
    """

    def __init__(self, nv: Any, handles: list[tuple[int, Any]], interval: float) -> None:
        self.nv, self.handles, self.interval = nv, handles, interval
        self._latest: dict[int, tuple[float | None, float | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sddoctor-pcie", daemon=True)
        self._unsupported: set[int] = set()
        self.rounds = 0
        self.round_seconds = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def latest(self) -> dict[int, tuple[float | None, float | None]]:
        with self._lock:
            return dict(self._latest)

    def sample_once(self) -> None:
        t0 = time.perf_counter()
        for index, handle in self.handles:
            if index in self._unsupported or self._stop.is_set():
                continue
            try:
                rx = self.nv.nvmlDeviceGetPcieThroughput(handle, self.nv.NVML_PCIE_UTIL_RX_BYTES)
                tx = self.nv.nvmlDeviceGetPcieThroughput(handle, self.nv.NVML_PCIE_UTIL_TX_BYTES)
            except Exception:  # noqa: BLE001 - NotSupported on some boards and in some VMs
                self._unsupported.add(index)
                continue
            with self._lock:
                self._latest[index] = (rx * 1024.0, tx * 1024.0)  # NVML reports KB/s
        self.rounds += 1
        self.round_seconds = time.perf_counter() - t0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)
