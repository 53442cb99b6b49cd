"""NvmlSource against a fake pynvml installed at the edge; the no-NVML path; the collector."""

from __future__ import annotations

import os
import threading
import time

import pytest

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.host import FixedHost, PsutilHost
from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.gpu.source import NvmlSource
from sddoctor.gpu.throttle import decode_clock_events, is_slowdown
from sddoctor.testing.fake_nvml import FakeGpu, FakeNvml, NVMLError, demo_gpus


@pytest.fixture(autouse=True)
def _reset_nvml():
    yield
    set_nvml_for_tests(None, None)


def test_readings_in_user_units():
    gpu = FakeGpu(
        memory_used=10 << 30,
        memory_total=80 << 30,
        util_series=[87],
        mem_util=40,
        power_mw=312_500,
        power_limit_mw=700_000,
        clock_events=0x4 | 0x40,
        ecc=(3, 1),
        processes=[(1234, 5 << 30), (1235, None)],
    )
    set_nvml_for_tests(FakeNvml([gpu], driver="570.86"))
    src = NvmlSource(pcie_interval=0)
    assert src.available and src.note is None and src.driver_version == "570.86"
    (s,) = src.sample()
    assert (s.index, s.name, s.pci_bus_id) == (0, "NVIDIA H200", "00000000:18:00.0")
    assert s.uuid.startswith("GPU-")
    assert (s.utilization_gpu, s.utilization_mem) == (87.0, 40.0)
    assert (s.memory_used, s.memory_total, s.memory_percent) == (10 << 30, 80 << 30, 12.5)
    assert (s.power_draw, s.power_limit) == (312.5, 700.0)
    assert (s.clock_sm, s.clock_mem, s.pstate, s.temperature) == (1980, 3201, 0, 35.0)
    assert s.clock_event_reasons == ["sw-power-cap", "hw-thermal"] and s.clock_event_mask == 0x44
    assert (s.ecc_corrected, s.ecc_uncorrected) == (3, 1)
    assert [(p.pid, p.gpu_memory) for p in s.processes] == [(1234, 5 << 30), (1235, None)]
    assert s.pcie_rx is None and s.errors == []


def test_unsupported_ecc_is_quiet_and_not_retried():
    fake = FakeNvml([FakeGpu(ecc=None)])
    set_nvml_for_tests(fake)
    src = NvmlSource(pcie_interval=0)
    for _ in range(5):
        (s,) = src.sample()
        assert s.ecc_corrected is None and s.ecc_uncorrected is None and s.errors == []
    assert fake.calls["ecc"] == 1  # NotSupported remembered after the first call


def test_other_nvml_errors_are_reported_not_raised():
    class Lost(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802 - pynvml's name
            raise NVMLError(15)  # GPU is lost

    set_nvml_for_tests(Lost([FakeGpu()]))
    (s,) = NvmlSource(pcie_interval=0).sample()
    assert s.power_draw is None and s.utilization_gpu == 0.0
    assert len(s.errors) == 1 and s.errors[0].startswith("power:")


def test_pcie_is_read_only_by_the_background_thread():
    fake = FakeNvml([FakeGpu(pcie_kb=(2000, 500)), FakeGpu(pcie_kb=None)])
    set_nvml_for_tests(fake)
    src = NvmlSource(pcie_interval=0.05)
    src.sample()
    assert "pcie" not in fake.calls  # never on the sampling path
    src.start_background()
    try:
        deadline = time.time() + 5
        while time.time() < deadline and src.sample()[0].pcie_rx is None:
            time.sleep(0.02)
        s0, s1 = src.sample()
        assert (s0.pcie_rx, s0.pcie_tx) == (2000 * 1024.0, 500 * 1024.0)
        assert s1.pcie_rx is None  # NotSupported on that board: stays empty, no error
    finally:
        src.close()
    assert src._pcie is None


def test_no_nvml_is_a_note_not_an_error():
    set_nvml_for_tests(None, "NVML could not start (NVML Shared Library Not Found): no NVIDIA driver")
    src = NvmlSource()
    src.start_background()  # nothing to start, must not fail
    assert not src.available and "Shared Library" in (src.note or "")
    snap = Collector(src, FixedHost()).sample()
    assert snap.gpus == [] and not snap.nvml_available and snap.host.hostname == "node0"


def test_open_in_background_returns_at_once_and_sampling_waits_for_it():
    opening = threading.Event()

    class SlowDriver(FakeNvml):
        def nvmlDeviceGetCount(self):  # noqa: N802 - pynvml's name
            opening.wait(10)  # the driver is still initialising
            return super().nvmlDeviceGetCount()

    set_nvml_for_tests(SlowDriver(demo_gpus(2, [[], []]), driver="570.86"))
    src = NvmlSource(pcie_interval=0, open_in_background=True)
    sampled: list[list] = []
    sampler = threading.Thread(target=lambda: sampled.append(src.sample()))
    sampler.start()
    sampler.join(0.2)
    assert sampler.is_alive() and not sampled  # waits for the opening instead of returning no GPUs
    opening.set()
    sampler.join(10)
    assert [g.index for g in sampled[0]] == [0, 1]
    assert src.available and src.device_count == 2 and src.driver_version == "570.86"


def test_open_in_background_without_nvml_gives_the_note():
    set_nvml_for_tests(None, "NVML could not start (NVML Shared Library Not Found): no NVIDIA driver")
    src = NvmlSource(open_in_background=True)
    assert src.sample() == [] and not src.available and "Shared Library" in (src.note or "")


def test_no_pcie_thread_starts_after_close():
    set_nvml_for_tests(FakeNvml([FakeGpu(pcie_kb=(1, 1))]))
    src = NvmlSource(pcie_interval=0.05)
    src.close()  # the app quit before its sampling thread got to start the PCIe reader
    src.start_background()
    assert src._pcie is None


def test_collector_fills_process_host_side_and_history():
    me = os.getpid()
    set_nvml_for_tests(FakeNvml(demo_gpus(2, [[(me, 1 << 30)], []])))
    collector = Collector(NvmlSource(pcie_interval=0), PsutilHost())
    for _ in range(3):
        snap = collector.sample()
    (p,) = snap.gpus[0].processes
    assert p.pid == me and p.rss and p.rss > 0 and p.user and "python" in (p.command or "").lower()
    assert p.cpu_percent is not None
    assert len(collector.history.get(1, "util")) == 3
    assert snap.sample_seconds is not None and snap.sample_seconds < 0.5


def test_clock_event_words():
    assert decode_clock_events(0) == [] and decode_clock_events(None) == []
    assert decode_clock_events(0x1) == ["idle"]
    assert decode_clock_events(0x8 | 0x80 | 0x10000) == ["hw-slowdown", "power-brake", "0x10000"]
    assert is_slowdown(0x4) and not is_slowdown(0x1 | 0x2)


def test_memory_info_falls_back_to_v1_on_an_old_driver():
    class OldDriver(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h, version=None):  # noqa: N802 - pynvml's name
            self._count("memory")
            if version is not None:
                raise NVMLError(13)  # function not found
            return super().nvmlDeviceGetMemoryInfo(h)

    fake = OldDriver([FakeGpu(memory_used=7 << 30)])
    set_nvml_for_tests(fake)
    src = NvmlSource(pcie_interval=0)
    assert [src.sample()[0].memory_used for _ in range(3)] == [7 << 30] * 3
    assert fake.calls["memory"] == 4  # one failed v2 call, then v1 only
