"""GPU utilisation and memory over a run: `RUN_DIR/gpus.jsonl`, sampled by `sddoctor run`.

The ranks report what torch allocated; only NVML sees what each GPU did (busy, memory in use by
every process, temperature, power). A thread of the supervisor samples the local GPUs every
`interval` seconds through `sddoctor.gpu`'s NVML source (about 10 us of NVML per GPU and sample,
measured on an H200; no PCIe or process-utilization reads) and appends one line:

    {"v": 1, "t": 1796206650.0, "host": "node0",
     "gpus": [{"index": 0, "name": "NVIDIA H200", "util": 97.0, "mem_used": 61203283968,
               "mem_total": 150754820096, "temp": 61.0, "power": 612.4, "pids": [4711]}]}

`util` is percent, memory in bytes, `temp` degrees C, `power` watts, `pids` the processes
holding memory on that GPU (host PIDs). Where NVML is missing (no NVIDIA driver) nothing is
written. The file is bounded like the timeline files (`append_bounded`: gpus.jsonl and
gpus.1.jsonl, about 2 x MAX_BYTES), so a week-long run keeps its most recent days.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sddoctor.telemetry import RunDir, read_events
from sddoctor.telemetry.layout import append_bounded, rotated_path
from sddoctor.telemetry.schema import SCHEMA_VERSION

GPU_LOG = "gpus.jsonl"
MAX_BYTES = 8 << 20
INTERVAL = 2.0


def gpu_log_path(run_dir: RunDir) -> Path:
    return run_dir.path / GPU_LOG


class GpuLog:
    """Background sampler of the local GPUs into RUN_DIR/gpus.jsonl."""

    def __init__(
        self,
        run_dir: RunDir,
        *,
        interval: float = INTERVAL,
        source_factory: Callable[[], Any] | None = None,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.run_dir = run_dir
        self.interval = interval
        self.max_bytes = max_bytes
        self.samples = 0
        self.note: str | None = None
        self._source_factory = source_factory
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuLog:
        self._thread = threading.Thread(target=self._run, name="sddoctor-gpulog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            source = self._open()
        except Exception as exc:  # noqa: BLE001 - a broken driver must not take the supervisor down
            self.note = f"NVML failed: {exc}"
            return
        if not source.available:
            self.note = source.note
            source.close()
            return
        host = socket.gethostname()
        try:
            while True:
                try:
                    self.sample_once(source, host)
                except Exception as exc:  # noqa: BLE001 - one failed read skips one sample
                    self.note = f"GPU sample failed: {exc}"
                if self._stop.wait(self.interval):
                    break
            self.sample_once(source, host)  # the state at the end
        except Exception:  # noqa: BLE001
            pass
        finally:
            source.close()

    def _open(self) -> Any:
        if self._source_factory is not None:
            return self._source_factory()
        from sddoctor.gpu.source import NvmlSource

        return NvmlSource(pcie_interval=0)

    def sample_once(self, source: Any, host: str) -> None:
        gpus = [
            {
                "index": g.index,
                "name": g.name,
                "util": g.utilization_gpu,
                "mem_used": g.memory_used,
                "mem_total": g.memory_total,
                "temp": g.temperature,
                "power": g.power_draw,
                "pids": sorted({p.pid for p in g.processes}),
            }
            for g in source.sample()
        ]
        line = {"v": SCHEMA_VERSION, "t": round(time.time(), 3), "host": host, "gpus": gpus}
        append_bounded(gpu_log_path(self.run_dir), json.dumps(line) + "\n", self.max_bytes)
        self.samples += 1


def read_gpu_log(run_dir: RunDir) -> list[dict[str, Any]]:
    """The GPU samples of a run, oldest first ([] when none were taken)."""
    path = gpu_log_path(run_dir)
    lines = read_events(rotated_path(path)) + read_events(path)
    return [x for x in lines if isinstance(x.get("t"), (int, float)) and isinstance(x.get("gpus"), list)]
