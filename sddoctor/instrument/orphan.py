"""No process of a job outlives its supervisor: a watchdog thread in every Python process of it.

`sddoctor run` holds an exclusive `flock` on RUN_DIR/supervisor.lease for as long as it lives and
names the file in SDDOCTOR_SUPERVISOR_LEASE. The kernel drops the lock when the supervisor dies,
however it dies (SIGKILL, the OOM killer, a closed SSH session). Each process started with the
bootstrap on PYTHONPATH (launchers, ranks, torch.multiprocessing children, DataLoader workers)
tries a shared lock on the same file once a second: it only gets one when nobody holds the
exclusive lock, that is, when the supervisor is gone. Then it records a `warning` event
(`supervisor_gone`) if it is a rank, stops writing to a stderr pipe nobody reads, sends itself
SIGTERM (so a trainer can still save on SIGTERM) and, `GRACE` seconds later, SIGKILL.

It works whoever the parent is (ranks under torchrun are its children, not sddoctor's; mp.spawn
children are the script's) and survives a fork (the thread is started again in the child).
Cost: one flock system call a second per process. Stdlib only; never raises into the process.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time

LEASE_ENV = "SDDOCTOR_SUPERVISOR_LEASE"
INTERVAL = 1.0
#: seconds between the SIGTERM and the SIGKILL a process sends itself once its supervisor is gone
GRACE = 5.0

_started_in: int | None = None  # pid that runs the watchdog (a forked child starts its own)
_fork_hook = False


def start(environ: dict[str, str] | None = None) -> bool:
    """Start the watchdog in this process if the job has a supervisor lease. True if started."""
    global _started_in, _fork_hook
    env = os.environ if environ is None else environ
    path = env.get(LEASE_ENV)
    if not path or _started_in == os.getpid():
        return False
    try:
        import fcntl  # noqa: F401 - POSIX only
    except ImportError:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False  # no lease to watch: the run directory is gone or unreadable
    _started_in = os.getpid()
    threading.Thread(target=_watch, args=(fd,), name="sddoctor-orphan-watch", daemon=True).start()
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=lambda: _restart_in_child(path))
        _fork_hook = True
    return True


def _restart_in_child(path: str) -> None:
    try:
        start({LEASE_ENV: path})
    except Exception:  # noqa: BLE001 - a fork must never fail because of us
        pass


def lease_locked(fd: int) -> bool | None:
    """Whether someone holds an exclusive lock on the lease file behind `fd` (None: cannot tell,
    e.g. a file system without locks). Takes and drops a shared lock to find out."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def supervisor_gone(fd: int) -> bool:
    """True when nobody holds the supervisor's lock on the lease behind `fd` (never when unsure)."""
    return lease_locked(fd) is False


def _watch(fd: int) -> None:
    while True:
        time.sleep(INTERVAL)
        try:
            if _started_in != os.getpid():
                return  # a forked child: its own watchdog (on its own descriptor) takes over
            if supervisor_gone(fd):
                break
        except Exception:  # noqa: BLE001 - never raise into the process
            return
    _stop_orphan()


def _stop_orphan() -> None:
    """The supervisor is gone: leave a note, then end this process (TERM, then KILL)."""
    try:
        _note_in_telemetry()
        _quiet_dead_pipes()
    except Exception:  # noqa: BLE001
        pass
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _note_in_telemetry() -> None:
    api = sys.modules.get("sddoctor.instrument.api")
    session = api.active() if api is not None else None
    if session is None:
        return
    from sddoctor.telemetry.writer import EXIT_FLUSH_TIMEOUT  # loaded with the session

    session.writer.emit(
        "warning",
        code="supervisor_gone",
        message="the sddoctor run supervisor is gone; this rank stops itself (SIGTERM, then SIGKILL)",
    )
    session.writer.flush(timeout=EXIT_FLUSH_TIMEOUT)


def _quiet_dead_pipes() -> None:
    """A stderr that is a pipe may have lost its reader with the supervisor (older supervisors
    read the job's stderr through one): writing to it would raise BrokenPipeError in the user's
    code on the way out, so it goes to /dev/null. stdout is the user's own and is left alone."""
    try:
        if not stat.S_ISFIFO(os.fstat(2).st_mode):
            return
    except OSError:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
    finally:
        os.close(devnull)
