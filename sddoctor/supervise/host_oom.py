"""The kernel's OOM killer: which processes it killed during a run (host memory, not GPU memory).

A rank, or one of its DataLoader workers, that the kernel kills because the host ran out of memory
dies of SIGKILL with no word of its own: "killed by signal 9", or "DataLoader worker (pid 1234) is
killed by signal: Killed." in the rank. The kernel's log names each pid it killed ("Killed process
1234 (python)"); where that log cannot be read (`kernel.dmesg_restrict`, a container), its counters
of OOM kills (`/proc/vmstat`, and a cgroup v2 `memory.events` of the supervisor's own cgroup) still
say that it killed something while the job ran.

`Baseline.take()` at the start of a run, `Baseline.since()` at its end: a JSON-ready record that the
diagnosis reads (`diagnose_crash`). Nothing here raises: an unreadable source is left out.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KMSG = Path("/dev/kmsg")
VMSTAT = Path("/proc/vmstat")
#: "Out of memory: Killed process 1234 (python) total-vm:..." and the memory cgroup's variant
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)")
#: records read from the kernel's ring buffer at most (it holds far fewer on any usual host)
_MAX_RECORDS = 200_000


def _boot_seconds() -> float:
    """Seconds since boot, as the kernel log stamps its records (suspend included)."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return time.monotonic()


def _oom_kill_count(path: Path) -> int | None:
    """The `oom_kill` line of a kernel counters file ("name value" lines: /proc/vmstat, a cgroup v2
    memory.events)."""
    try:
        for line in path.read_text(encoding="ascii", errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _cgroup_events(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> Path | None:
    """This process's cgroup v2 `memory.events`, which counts its descendants' kills too; None on
    cgroup v1, whose counter does not."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            return root / path.lstrip("/") / "memory.events"
    return None


def counters() -> dict[str, int]:
    """The kernel's OOM-kill counters that can be read here, by source."""
    events = _cgroup_events()
    found = {
        "/proc/vmstat": _oom_kill_count(VMSTAT),
        "cgroup memory.events": _oom_kill_count(events) if events is not None else None,
    }
    return {name: count for name, count in found.items() if count is not None}


def kernel_log_kills(since_boot: float, path: Path = KMSG) -> dict[int, str] | None:
    """pid -> command of every process the OOM killer killed after `since_boot` (seconds since
    boot), read from the kernel's ring buffer; None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    killed: dict[int, str] = {}
    try:
        for _ in range(_MAX_RECORDS):
            try:
                record = os.read(fd, 8192).decode("utf-8", errors="replace")
            except BlockingIOError:
                break  # read to the end
            except BrokenPipeError:
                continue  # the oldest records were overwritten while we read: go on
            except OSError:
                return killed or None
            if not record:
                break
            header, _, message = record.partition(";")
            fields = header.split(",")
            try:
                stamp = int(fields[2]) / 1e6
            except (IndexError, ValueError):
                continue
            match = _KILLED.search(message)
            if match and stamp >= since_boot:
                killed[int(match.group(1))] = match.group(2)
    finally:
        os.close(fd)
    return killed


@dataclass(frozen=True)
class Baseline:
    """The counters and the boot clock at the start of a run."""

    counts: dict[str, int]
    boot_seconds: float

    @classmethod
    def take(cls) -> Baseline:
        return cls(counters(), _boot_seconds())

    def since(self) -> dict[str, Any]:
        """What the OOM killer did since the baseline: `kills` (the largest increase of any counter,
        with its `source`), and `killed` (pid -> command, from the kernel log) when it can be read.
        The log is read only when a counter moved or none can be read."""
        now = counters()
        increases = {name: now[name] - before for name, before in self.counts.items() if name in now}
        record: dict[str, Any] = {"kills": None, "source": None, "killed": None}
        if increases:
            source = max(increases, key=lambda name: increases[name])
            record.update(kills=max(increases[source], 0), source=source)
        if record["kills"] != 0:
            killed = kernel_log_kills(self.boot_seconds - 1.0)
            if killed is not None:
                record["killed"] = {str(pid): command for pid, command in killed.items()}
                if record["kills"] is None:
                    record.update(kills=len(killed), source="kernel log")
        return record
