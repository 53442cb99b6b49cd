"""What ties the job's life to the supervisor's, and what the run directory says about it.

- `SupervisorLease`: RUN_DIR/supervisor.lease, locked (flock, exclusive) by `sddoctor run` for as
  long as it lives, its mtime touched every second. The job's processes watch the lock
  (`sddoctor.instrument.orphan`) and stop themselves once it is free; `sddoctor report` reads it
  to say whether the supervisor ended, runs, or died and when it was last seen.
- `die_with_parent()`: the launcher gets SIGTERM the moment the supervisor dies (Linux
  PR_SET_PDEATHSIG), so torchrun stops its workers at once.
- `StderrLog`: the job's stderr goes to RUN_DIR/stderr.log, which the supervisor follows and
  copies to its own stderr. A file, unlike a pipe, never fills up when the reader is slow and
  never raises EPIPE when the reader is gone, so no rank dies of writing to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

LEASE_FILE = "supervisor.lease"
STDERR_FILE = "stderr.log"
LEASE_SCHEMA = "sddoctor.lease/1"
HEARTBEAT_SECONDS = 1.0
#: a lease on another host (a shared file system) untouched this long belongs to a dead supervisor
STALE_SECONDS = 30.0
_PR_SET_PDEATHSIG = 1


class LeaseHeld(Exception):
    """Another live supervisor holds this run directory's lease."""


class SupervisorLease:
    """The exclusive lock and heartbeat of one `sddoctor run` on its run directory."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        self.path = Path(run_dir) / LEASE_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise LeaseHeld(f"another sddoctor run is using {run_dir}; choose another --run-dir") from None
        except OSError:
            pass  # a file system without locks: the heartbeat alone tells the story
        self.record: dict[str, Any] = {
            "schema": LEASE_SCHEMA,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "heartbeat_seconds": HEARTBEAT_SECONDS,
        }
        self._write()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="sddoctor-lease", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        data = json.dumps(self.record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data + b"\n", 0)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self._fd)
            except OSError:
                pass

    def end(self, outcome: str, exit_code: int | None) -> None:
        """The supervisor finishes normally: say so in the lease (the lock goes with the process)."""
        self._stop.set()
        self.record.update(ended=time.time(), outcome=outcome, exit_code=exit_code)
        try:
            self._write()
        except OSError:
            pass


def lease_status(run_dir: str | os.PathLike[str], now: float | None = None) -> dict[str, Any] | None:
    """What the lease says about the run's supervisor, or None when there is none (not a run of
    `sddoctor run`, or one from before leases). `state`: "ended", "running" or "died"; `last_seen`:
    the last heartbeat (unix time); for "died", `died_at` is that heartbeat (within a second)."""
    path = Path(run_dir) / LEASE_FILE
    now = time.time() if now is None else now
    try:
        st = path.stat()
        record = json.loads(path.read_text(encoding="utf-8")[:65536] or "{}")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    out: dict[str, Any] = {
        k: record.get(k) for k in ("pid", "host", "started", "ended", "outcome", "exit_code") if k in record
    }
    out["last_seen"] = st.st_mtime
    if isinstance(record.get("ended"), (int, float)):
        out["state"] = "ended"
        return out
    held = _lock_held(path) if record.get("host") == socket.gethostname() else None
    if held is None:
        held = now - st.st_mtime < STALE_SECONDS
    out["state"] = "running" if held else "died"
    if not held:
        out["died_at"] = st.st_mtime
    return out


def _lock_held(path: Path) -> bool | None:
    from sddoctor.instrument.orphan import lease_locked

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return lease_locked(fd)
    except ImportError:  # no fcntl: not a POSIX system
        return None
    finally:
        os.close(fd)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when this process dies (Linux), or None.

    libc and the parent's pid are looked up here, in the parent, so that the function run
    between fork and exec only makes two system calls."""
    if not os.uname().sysname == "Linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: act as if it had been set
            os.kill(os.getpid(), sig)

    return preexec


class StderrLog:
    """The job's stderr: a file in the run directory that the supervisor follows."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / STDERR_FILE
        # O_APPEND: every process of the job writes at the end, whatever the others wrote;
        # O_TRUNC: a run directory used again does not show the last run's lines again
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(self.path, flags, 0o600)

    def follow(
        self,
        sink: IO[str],
        on_line: Callable[[str], None],
        stop: threading.Event,
        mute: threading.Event | None = None,
    ) -> None:
        """Copy what the job writes to `sink` (until `mute` is set: the file keeps all) and hand each
        line to `on_line`, until `stop` is set (then once more, for the last words). Never raises: a
        broken sink is skipped."""
        partial = b""
        with open(self.path, "rb") as fh:
            while True:
                stopping = stop.wait(0.05)
                chunk = fh.read()
                shown = None if mute is not None and mute.is_set() else sink
                if chunk:
                    partial = _emit(partial + chunk, shown, on_line)
                if stopping:
                    if partial:
                        _emit(partial + b"\n", shown, on_line)
                    break
        try:
            os.close(self.fd)
        except OSError:
            pass


#: The most of one stderr line the supervisor keeps for its diagnosis (the console and stderr.log
#: get all of it): the start, where an error names itself, and the end.
TAIL_LINE_HEAD = 3000
TAIL_LINE_END = 1000


def tail_text(line: str) -> str:
    """What the diagnosis keeps of one stderr line: what a terminal shows of it (after the last
    carriage return: a progress bar redrawn in place 100,000 times is one bar), at most
    TAIL_LINE_HEAD + TAIL_LINE_END characters. Unbounded lines would make every error pattern
    the diagnosis looks for scan megabytes."""
    line = line.rstrip("\r")
    if "\r" in line:
        line = line.rsplit("\r", 1)[1]
    if len(line) > TAIL_LINE_HEAD + TAIL_LINE_END:
        cut = len(line) - TAIL_LINE_HEAD - TAIL_LINE_END
        line = f"{line[:TAIL_LINE_HEAD]} [... {cut} characters ...] {line[-TAIL_LINE_END:]}"
    return line


def _emit(data: bytes, sink: IO[str] | None, on_line: Callable[[str], None]) -> bytes:
    """Write the complete lines of `data` (to `sink` unless None); return the unfinished rest."""
    *lines, rest = data.split(b"\n")
    for raw in lines:
        line = raw.decode("utf-8", errors="replace")
        try:
            on_line(tail_text(line))
        except Exception:  # noqa: BLE001
            pass
        if sink is None:
            continue
        try:
            sink.write(line + "\n")
        except (OSError, ValueError):
            pass
    try:
        if sink is not None:
            sink.flush()
    except (OSError, ValueError):
        pass
    if len(rest) > 1 << 20:  # a megabyte without a newline (a progress bar on \r): pass it on
        _emit(rest + b"\n", sink, on_line)
        return b""
    return rest


def job_environment(lease: SupervisorLease | None) -> dict[str, str]:
    """The variables that let the job's processes watch the supervisor."""
    from sddoctor.instrument.orphan import LEASE_ENV

    return {LEASE_ENV: str(lease.path)} if lease is not None else {}


def describe(status: dict[str, Any] | None) -> Iterable[str]:
    """Lines for `sddoctor report` about a supervisor that did not end normally."""
    if not status or status.get("state") != "died":
        return []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status["died_at"]))
    return [
        f"  supervisor: sddoctor run (pid {status.get('pid')} on {status.get('host')}) died at about {when} "
        "(last heartbeat) without finishing; its job's processes stop themselves when it is gone"
    ]
