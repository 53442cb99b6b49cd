"""The live runs of this user on this host: one small entry file per running `sddoctor run`.

`sddoctor run` announces itself when it starts (its pid, run directory, state endpoint, command,
working directory and start time) and removes its entry when it ends; `sddoctor tui` lists the
entries to find every running supervisor without being told where its run directory is.

    $XDG_RUNTIME_DIR/sddoctor/runs/<host>-<pid>.json     (else ~/.cache/sddoctor/runs/)

The directory is 0700 and each entry 0600: a command line can hold secrets, and only its own
user should see it. A directory or an entry owned by another user is never used. An entry whose
process is gone (the supervisor was killed with SIGKILL, the machine rebooted) or whose pid now
belongs to another process (told apart by the process start time in /proc) is stale: readers
ignore it and delete it. Entries of other hosts (a home directory shared over NFS) are left
alone. Stdlib only, like the rest of the telemetry package.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sddoctor.telemetry.layout import RunDir
from sddoctor.telemetry.runinfo import read_run_info

ENTRY_VERSION = 1
MAX_ENTRY_BYTES = 64 * 1024


def registry_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the entries live: under $XDG_RUNTIME_DIR when it is set, else under ~/.cache."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "sddoctor" / "runs"
    cache = env.get("XDG_CACHE_HOME")
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / "sddoctor" / "runs"


@dataclass
class LiveRun:
    """One running `sddoctor run`, as its entry describes it."""

    pid: int
    run_dir: Path
    endpoint: str | None
    command: list[str]
    cwd: str | None
    started: float
    host: str
    entry: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.run_dir.name


class Announcement:
    """The entry of this process; `remove()` deletes it (at most once, and only if still ours)."""

    def __init__(self, path: Path | None, problem: str | None = None) -> None:
        self.path = path
        self.problem = problem  # why no entry was written, in words; None when it was

    def remove(self) -> None:
        path, self.path = self.path, None
        if path is None:
            return
        try:
            os.unlink(path)
        except OSError:
            pass


def announce(
    run_dir: RunDir | str | os.PathLike[str],
    command: list[str] | None = None,
    *,
    endpoint: str | None = None,
    started: float | None = None,
    directory: Path | None = None,
) -> Announcement:
    """Write this process's entry. The endpoint, command and start time not given are taken from
    the run's run.json. Never raises: a registry that cannot be written only means `sddoctor tui`
    will not find this run by itself (the reason is in `problem`)."""
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    info = read_run_info(run_dir)
    if endpoint is None:
        endpoint = info.endpoint
    if command is None:
        command = list(info.command)
    if started is None:
        started = info.started if info.started is not None else time.time()
    try:
        where = _own_dir(directory or registry_dir(), create=True)
        host = socket.gethostname()
        entry = {
            "v": ENTRY_VERSION,
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "host": host,
            "run_dir": str(run_dir.path.resolve()),
            "endpoint": endpoint,
            "command": [str(a) for a in command],
            "cwd": os.getcwd(),
            "started": float(started),
        }
        path = where / f"{_safe(host)}-{os.getpid()}.json"
        tmp = where / f".{path.name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entry, fh)
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        return Announcement(None, f"cannot write the live-run entry: {exc}")
    handle = Announcement(path)
    atexit.register(handle.remove)  # a safety net; the supervisor removes it itself when it ends
    return handle


def live_runs(directory: Path | None = None, clean: bool = True) -> list[LiveRun]:
    """The live runs of this user on this host, newest first; stale entries are deleted (`clean`)."""
    try:
        where = _own_dir(directory or registry_dir(), create=False)
    except OSError:
        return []
    host = socket.gethostname()
    found = []
    for path in sorted(where.glob("*.json")):
        run = _read_entry(path)
        if run is None:
            continue
        if run.host != host:
            continue  # another machine sharing this home directory: not ours to judge
        if not _alive(run.pid, run.extra.get("pid_start")):
            if clean:
                try:
                    path.unlink()
                except OSError:
                    pass
            continue
        found.append(run)
    found.sort(key=lambda r: r.started, reverse=True)
    return found


def find_live_run(run_dir: str | os.PathLike[str], directory: Path | None = None) -> LiveRun | None:
    """The live run writing into `run_dir`, if there is one."""
    target = Path(run_dir).resolve()
    for run in live_runs(directory, clean=False):
        if run.run_dir == target:
            return run
    return None


def _own_dir(path: Path, create: bool) -> Path:
    """`path` when it is a directory of this user (made 0700); raises OSError otherwise."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def _read_entry(path: Path) -> LiveRun | None:
    """One entry, or None when it is not a well-formed entry file of this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_ENTRY_BYTES:
            return None
        doc = json.loads(os.read(fd, MAX_ENTRY_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(doc, dict):
        return None
    pid, run_dir, host = doc.get("pid"), doc.get("run_dir"), doc.get("host")
    command, started = doc.get("command"), doc.get("started")
    if not (isinstance(pid, int) and pid > 0 and isinstance(run_dir, str) and isinstance(host, str)):
        return None
    endpoint = doc.get("endpoint") if isinstance(doc.get("endpoint"), str) else None
    cwd = doc.get("cwd") if isinstance(doc.get("cwd"), str) else None
    return LiveRun(
        pid=pid,
        run_dir=Path(run_dir),
        endpoint=endpoint,
        command=[str(a) for a in command] if isinstance(command, list) else [],
        cwd=cwd,
        started=float(started) if isinstance(started, (int, float)) else 0.0,
        host=host,
        entry=path,
        extra={"pid_start": doc.get("pid_start")},
    )


def _alive(pid: int, pid_start: Any) -> bool:
    """Whether `pid` is still the process that wrote the entry."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # it exists but belongs to another user: the pid was reused
    except OSError:
        return True
    now_start = _process_start(pid)
    return pid_start is None or now_start is None or now_start == pid_start


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None where
    there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after its end
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "host"
