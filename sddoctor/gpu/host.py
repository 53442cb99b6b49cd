"""The host side through psutil: CPU, memory, load, and who each GPU process is.

psutil's CPU percentages are deltas between two calls on the same object, so `ProcessTable`
keeps one `psutil.Process` per pid across samples (and forgets pids that are gone); user
names and command lines do not change, so they are read once per process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import psutil

from sddoctor.gpu.samples import HostSample
from sddoctor.telemetry.redact import redact_argv

T = TypeVar("T")


@dataclass
class ProcessInfo:
    user: str | None
    cpu_percent: float | None
    rss: int | None
    command: str | None


class HostSampler(Protocol):
    def host(self) -> HostSample: ...

    def processes(self, pids: list[int]) -> dict[int, ProcessInfo]: ...


class PsutilHost:
    """The real host. The first CPU figures after construction are 0 (psutil needs two points)."""

    def __init__(self) -> None:
        self.hostname = socket.gethostname()
        self._cpu_count = psutil.cpu_count()
        psutil.cpu_percent(interval=None)  # prime the system-wide delta
        self._procs: dict[int, tuple[psutil.Process, str | None, str | None]] = {}

    def host(self) -> HostSample:
        mem = psutil.virtual_memory()
        try:
            load = os.getloadavg()
        except (AttributeError, OSError):  # not on this platform
            load = None
        return HostSample(
            hostname=self.hostname,
            cpu_percent=psutil.cpu_percent(interval=None),
            cpu_count=self._cpu_count,
            memory_used=int(mem.total - mem.available),
            memory_total=int(mem.total),
            load_average=tuple(load) if load else None,  # type: ignore[arg-type]
        )

    def processes(self, pids: list[int]) -> dict[int, ProcessInfo]:
        out: dict[int, ProcessInfo] = {}
        for pid in pids:
            entry = self._procs.get(pid)
            try:
                if entry is None:
                    proc = psutil.Process(pid)
                    with proc.oneshot():
                        user = _safe(proc.username)
                        cmdline = _safe(proc.cmdline)
                        command = " ".join(redact_argv(cmdline)) if cmdline else _safe(proc.name)
                    proc.cpu_percent(interval=None)  # prime; the first reading is 0 anyway
                    entry = (proc, user, command)
                    self._procs[pid] = entry
                proc, user, command = entry
                with proc.oneshot():
                    cpu = proc.cpu_percent(interval=None)
                    rss = proc.memory_info().rss
                out[pid] = ProcessInfo(user=user, cpu_percent=cpu, rss=int(rss), command=command)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                # In a container NVML reports host PIDs that do not exist here: show them plainly.
                self._procs.pop(pid, None)
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        return out


def _safe(getter: Callable[[], T]) -> T | None:
    try:
        return getter()
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return None


class FixedHost:
    """A host that always reports the same figures: deterministic screens in tests and docs."""

    def __init__(
        self,
        hostname: str = "node0",
        cpu_percent: float = 12.5,
        memory_used: int = 48 << 30,
        memory_total: int = 256 << 30,
        load_average: tuple[float, float, float] = (1.5, 1.2, 0.9),
        processes: dict[int, ProcessInfo] | None = None,
    ) -> None:
        self._host = HostSample(hostname, cpu_percent, 32, memory_used, memory_total, load_average)
        self._processes = processes or {}

    def host(self) -> HostSample:
        return self._host

    def processes(self, pids: list[int]) -> dict[int, ProcessInfo]:
        return {pid: self._processes[pid] for pid in pids if pid in self._processes}


def pid_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited. A zombie (exited, not yet reaped by its
    parent, e.g. a rank whose supervisor was killed, waiting for init to reap it) counts as gone,
    where psutil.pid_exists would still count it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
