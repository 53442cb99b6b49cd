"""Last words of a rank: the uncaught exception and SIGTERM, flushed before the process dies.

- `sys.excepthook` is chained: an `exception` event (type, message, traceback frames, caller)
  is written and flushed, then the previous hook prints the traceback as usual.
- `threading.excepthook` is chained: a thread's uncaught exception is a `thread_exception`
  warning (the rank goes on; its peers may wait for the collectives that thread never issues).
- A process forked from the rank (a multiprocessing or DataLoader worker) inherits all of this
  but is not the rank: it records nothing and gets SIGTERM back as it was.
- `sys.exit` and `os._exit` are wrapped: a failure status notes the user's line that called it,
  and `os._exit`, which skips atexit, writes the `exit` event and flushes first.
- Fatal signals (SIGSEGV, SIGABRT from gloo/NCCL, SIGFPE, SIGBUS, SIGILL): `faulthandler`
  writes the Python stack of every thread to `ranks/rank-NNNNN.fatal` (left alone if the
  program enabled faulthandler for a file already; on for stderr from the start, by
  PYTHONFAULTHANDLER or `-X faulthandler`, it is taken over; a later `faulthandler.enable()` for stderr, as
  torch.distributed.elastic's `@record` makes, keeps that file, one for another file is done).
  No Python code can run there, so this is the only record of where such a rank was.
- SIGTERM (what torchrun sends to the surviving ranks when one fails): a Python handler
  flushes and then does what the previous disposition did (a previous Python handler is
  called; the default action is re-raised so the exit status stays "killed by SIGTERM").
  A Python handler only runs when the main thread executes bytecode, which a rank stuck inside
  a collective never does; so the signal is also seen through `signal.set_wakeup_fd` by a
  watcher thread, which flushes at once and, when the default action was in force and the main
  thread has not acted within `grace` seconds, restores it and re-sends SIGTERM. A stuck rank
  therefore still dies promptly, as it would without sddoctor.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from sddoctor.codepaths import current_roots
from sddoctor.instrument.position import innermost_user_frame
from sddoctor.telemetry.writer import EXIT_FLUSH_TIMEOUT

_installed: dict[str, Any] = {}


def exception_fields(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    """The fields of an `exception` event."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    roots = current_roots()
    caller = None
    for fs in reversed(frames):  # the innermost frame of the user's own code
        if roots.is_user(fs.filename):
            caller = f"{fs.filename}:{fs.lineno}"
            break
    if caller is None:  # caught by library code (Lightning's handler of KeyboardInterrupt, then
        # sys.exit(1)): its traceback starts where it was caught; the user's line that called in
        # is among the frames above that one
        caller = _outer_user_line(tb)
    if caller is None:  # none: the innermost outside torch and sddoctor, else the innermost
        outside = [fs for fs in frames if not roots.is_internal(fs.filename)]
        chosen = outside[-1] if outside else (frames[-1] if frames else None)
        if chosen is not None:
            caller = f"{chosen.filename}:{chosen.lineno}"
    message = str(exc)
    remote = _remote_traceback(exc)
    if remote:
        message = f"{message}\n\nCaught {type(exc).__name__} in multiprocessing worker. Original {remote}"
    return {
        "type": type(exc).__name__,
        "message": message[-4000:] if remote else message[:4000],
        "traceback": [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in frames][-64:],
        "caller": caller,
    }


def handled_error_fields(exc: BaseException) -> dict[str, Any]:
    """What a rank keeps of an error its program caught and reported: type, message, the innermost
    line of the user's code in its traceback (where it was raised), and when. Read from the frames'
    code objects without source lines: a program may report errors often."""
    roots = current_roots()
    caller = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if roots.is_user(filename):
            caller = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return {"type": type(exc).__name__, "message": str(exc)[:500], "caller": caller, "t": time.time()}


def _outer_user_line(tb: TracebackType | None) -> str | None:
    """The innermost frame of the user's code among those that called the frame where the
    exception was caught (None for an uncaught one, whose traceback starts at the top)."""
    found = innermost_user_frame(tb.tb_frame.f_back) if tb is not None else None
    return found["at"] if found else None


def frame_position(frame: Any) -> dict[str, Any]:
    """Where a thread whose innermost frame is `frame` stands, as an `exit` event says it
    (`at`, `at_function`, `stack`): the innermost frame of the user's own code, and the whole Python
    stack, innermost last. Without a frame of the user's (a rank held in an atexit callback after
    its script ended) there is no line to name: nothing."""
    if frame is None:
        return {}
    # the innermost 64 frames, outermost first; no source lines read (this runs as the process dies)
    walked = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=64, lookup_lines=False)
    frames = list(reversed(walked))
    roots = current_roots()
    chosen = next((fs for fs in reversed(frames) if roots.is_user(fs.filename)), None)
    if chosen is None:
        return {}
    return {
        "at": f"{chosen.filename}:{chosen.lineno}",
        "at_function": chosen.name,
        "stack": [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in frames],
    }


def _main_thread_frame() -> Any:
    """The main thread's current frame; when the main thread is already running sddoctor's SIGTERM
    handler, the frame that handler interrupted (the handler's own frames are not the rank's)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    handler = getattr(_installed.get("sigterm"), "__code__", None)
    walk = frame
    while walk is not None and handler is not None:
        if walk.f_code is handler:
            return walk.f_back
        walk = walk.f_back
    return frame


def _note_signal_position(frame: Any) -> None:
    """Keep where the main thread was when SIGTERM came, for the `exit` event: a rank that the
    launcher stops (a peer failed or timed out) has no other record of the line it was stuck at."""
    session = _own_session()
    if session is None:
        return
    try:
        session.note_signal_position(frame_position(frame))
    except Exception:  # noqa: BLE001 - the process is being stopped: never stand in the way
        pass


def _remote_traceback(exc: BaseException) -> str | None:
    """The worker's traceback of an exception re-raised from a `multiprocessing.Pool` or a
    `ProcessPoolExecutor` worker: its cause, a RemoteTraceback, holds the text (the rank's own
    traceback ends in the pool's `get`, which names no line of the user's function)."""
    cause = exc.__cause__
    if cause is None or "RemoteTraceback" not in type(cause).__name__:
        return None
    text = str(getattr(cause, "tb", None) or cause)
    start = text.find("Traceback (most recent call last):")
    if start < 0:
        return None
    return text[start:].replace('"""', "").rstrip()


def uncaught_exception() -> BaseException | None:
    """The exception that ended the main script, read at exit; None when none did.

    Python keeps what it printed as uncaught in sys.last_value (sys.last_exc from 3.12) before it
    calls sys.excepthook, whoever installed that. The same attribute is set by an interactive
    prompt or by C code that prints an error it handles, so only a traceback that starts in the
    main module (a script, or runpy for `python -m`) is taken as the one that ended the program.
    """
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException) or isinstance(exc, SystemExit):
        return None
    tb = exc.__traceback__
    if tb is None:
        return None
    outer = tb.tb_frame
    if outer.f_globals.get("__name__") in ("__main__", "runpy") or outer.f_code.co_filename.endswith(
        "runpy>"
    ):
        return exc
    return None


def enable_fatal_dump(path: Path) -> bool:
    """faulthandler into `path` (appended), unless already enabled. True if enabled now."""
    import faulthandler

    if faulthandler.is_enabled() and "fatal_file" not in _installed and not _enabled_for_stderr_at_start():
        return False
    old = _installed.pop("fatal_file", None)
    fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - must stay open for the signal handler
    _keep_fatal_dump_on_stderr_enable()
    _installed["faulthandler.enable"](fh, all_threads=True)
    _installed["fatal_file"] = fh
    if old is not None:
        old.close()
    return True


def _enabled_for_stderr_at_start() -> bool:
    """Whether faulthandler is on because the interpreter turned it on for stderr as it started
    (PYTHONFAULTHANDLER, `-X faulthandler`), not because the program chose a file. Such a dump, on
    the job's stderr that all ranks share, names no rank: the rank's file takes it over, as it does
    a later `faulthandler.enable()` for stderr."""
    if "faulthandler" in sys._xoptions:
        return True
    return not sys.flags.ignore_environment and bool(os.environ.get("PYTHONFAULTHANDLER"))


def _keep_fatal_dump_on_stderr_enable() -> None:
    """Wrap faulthandler.enable so that a later call for stderr (its default) keeps the rank's dump
    file: torch.distributed.elastic's @record calls it on every decorated main, and the job's
    stderr is a stream of all ranks that names none of them, so the dump would no longer tell
    which rank died where. A call for another file is the program's choice and is done as asked."""
    import faulthandler

    if "faulthandler.enable" in _installed:
        return
    original = faulthandler.enable
    _installed["faulthandler.enable"] = original

    def enable(*args: Any, **kwargs: Any) -> None:
        try:
            target = args[0] if args else kwargs.get("file", sys.stderr)
            keep = "fatal_file" in _installed and (target is sys.stderr or target is sys.__stderr__)
        except Exception:  # noqa: BLE001 - the program's call goes through then
            keep = False
        if not keep:
            original(*args, **kwargs)
            _installed.pop("fatal_file", None)  # the program's own file from now on
        elif not faulthandler.is_enabled():  # the program disabled it first: on again, into our file
            try:
                original(_installed["fatal_file"], all_threads=True)
            except Exception:  # noqa: BLE001 - never into the program's call
                original(*args, **kwargs)

    enable.__doc__ = original.__doc__
    faulthandler.enable = enable


def install(session: Any, *, grace: float = 1.0) -> None:
    """Chain sys.excepthook and SIGTERM to `session` (an api.RankSession). Idempotent."""
    _installed["session"] = session
    if "excepthook" not in _installed:
        previous = sys.excepthook
        _installed["excepthook"] = previous

        def hook(etype: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            current = _own_session()
            if current is not None:
                try:
                    current.record_exception(exc, tb)
                except Exception:  # noqa: BLE001 - the original hook must still run
                    pass
            previous(etype, exc, tb)

        sys.excepthook = hook
    if "threading.excepthook" not in _installed:
        _install_thread_hook()
    if "sys.exit" not in _installed:
        _install_exit_caller()
    if "os._exit" not in _installed:
        _install_os_exit()
    if "traceback.print_exception" not in _installed:
        _install_error_reports()
    if "sigterm" not in _installed and threading.current_thread() is threading.main_thread():
        _install_sigterm(grace)


def _install_thread_hook() -> None:
    """Chain threading.excepthook: a thread of the rank that dies of an uncaught exception (a
    metrics or prefetch thread issuing its own collectives) leaves a `thread_exception` warning,
    and the peers' threads may then wait forever for the collectives it never issues. Python
    prints the traceback to stderr and the rank goes on, so nothing else records it."""
    previous = threading.excepthook
    _installed["threading.excepthook"] = previous

    def hook(args: Any) -> None:
        current = _own_session()
        if current is not None and args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            try:
                fields = exception_fields(args.exc_value, args.exc_traceback)
                name = getattr(args.thread, "name", None) or "?"
                message = f"thread {name!r} ended with {fields['type']}: {fields['message'][:300]}"
                error = fields.pop("message")
                current.note_thread_exception(message, thread=name, error=error, **fields)
            except Exception:  # noqa: BLE001 - the original hook must still run
                pass
        previous(args)

    threading.excepthook = hook


def _install_exit_caller() -> None:
    """Wrap sys.exit to note where the user's code ended the process with a failure status: a
    SystemExit never reaches sys.excepthook, and the exit status alone names no line."""
    original = sys.exit
    _installed["sys.exit"] = original

    def exit_noting_caller(status: object = None) -> None:
        try:
            current = _own_session()
            if current is not None:
                from sddoctor.instrument.tracing import user_caller  # only on the way out

                # the innermost user frame: argparse's parser.error calls sys.exit for its caller
                if status in (None, 0):
                    current.note_clean_exit_call(user_caller(), sys.exc_info()[1])
                else:
                    current.note_exit_call(user_caller(), status, sys.exc_info()[1])
        except Exception:  # noqa: BLE001 - the exit itself must happen
            pass
        original(status)  # type: ignore[arg-type]

    sys.exit = exit_noting_caller  # type: ignore[assignment]


def _install_os_exit() -> None:
    """Wrap os._exit: it skips atexit and the excepthook, so without this the rank's buffered events,
    its exit status and the line that ended it would be lost."""
    original = os._exit
    _installed["os._exit"] = original

    def exit_flushing(status: int) -> None:
        try:
            current = _own_session()  # a forked worker ends with os._exit: it is not the rank
            if current is not None:
                from sddoctor.instrument.tracing import user_caller  # only on the way out

                if status != 0:
                    current.note_exit_call(user_caller(), status, sys.exc_info()[1])
                else:
                    current.note_clean_exit_call(user_caller(), sys.exc_info()[1])
                current.exit_now("ok" if status == 0 else "error", status)
        except Exception:  # noqa: BLE001 - the exit itself must happen
            pass
        original(status)

    os._exit = exit_flushing  # type: ignore[assignment]


def _install_error_reports() -> None:
    """Wrap traceback.print_exception (print_exc calls it) and logging.Logger.exception: a program
    that catches an error, reports it and ends with code 0 (`except Exception:
    traceback.print_exc()` around its main) leaves no other trace of why the rank left its loop, and
    its peers then fail or wait for collectives it never issues. The last one is noted for the exit
    event; the program's call is made exactly as it was."""
    import logging

    print_exception = traceback.print_exception
    log_exception = logging.Logger.exception
    _installed["traceback.print_exception"] = print_exception
    _installed["logging.Logger.exception"] = log_exception

    def print_exception_noted(exc: Any, /, *args: Any, **kwargs: Any) -> None:
        value = args[0] if args and isinstance(args[0], BaseException) else kwargs.get("value", exc)
        _note_handled(value)
        print_exception(exc, *args, **kwargs)

    def exception_noted(self: logging.Logger, msg: object, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("exc_info", True) is True:
            _note_handled(sys.exc_info()[1])
        level = kwargs.get("stacklevel", 1)
        if isinstance(level, int):  # one frame more to skip: the record's line stays the program's
            kwargs["stacklevel"] = level + 1
        log_exception(self, msg, *args, **kwargs)

    functools.update_wrapper(print_exception_noted, print_exception)
    functools.update_wrapper(exception_noted, log_exception)
    traceback.print_exception = print_exception_noted
    logging.Logger.exception = exception_noted  # type: ignore[method-assign]


def _note_handled(exc: object) -> None:
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not an error of the program
        return
    current = _own_session()
    if current is None:
        return
    try:
        current.note_handled_error(exc)
    except Exception:  # noqa: BLE001 - the program's report must still be printed
        pass


def _install_sigterm(grace: float) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:
        return  # ignored on purpose, or set from C: leave it alone
    handled = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        _note_signal_position(frame)
        if callable(previous):
            handled.set()
            _flush(None, 0)  # the script's own handler decides whether (and how) the process ends
            previous(signum, frame)
        else:
            # `handled` only after the flush: if it blocks (the signal interrupted a flush on this
            # thread), the watcher thread still ends the process after its grace period
            _flush("signal", 128 + signum)
            handled.set()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed["sigterm"] = on_sigterm
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    os.set_blocking(read_fd, False)
    try:
        old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        return
    if old_fd != -1:  # someone (an event loop) already listens: do not steal it
        signal.set_wakeup_fd(old_fd)
        os.close(read_fd)
        os.close(write_fd)
        return
    _installed["sigterm_pipe"] = (read_fd, write_fd, previous)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(
            before=_block_sigterm_for_fork,
            after_in_parent=_unblock_sigterm_after_fork,
            after_in_child=_forget_sigterm_in_child,
        )
    default_action = not callable(previous)
    threading.Thread(
        target=_watch_signals,
        args=(read_fd, handled, default_action, on_sigterm, grace),
        name="sddoctor-signals",
        daemon=True,
    ).start()


def _block_sigterm_for_fork() -> None:
    """SIGTERM blocked in the forking thread until the child has let go of the rank's wake-up
    pipe: a child terminated between its fork and its at-fork handlers (a Pool worker started
    just as the pool is terminated) would otherwise write the byte into the pipe it shares with
    the rank, whose watcher would take it for the rank's own. Blocked, the signal waits in the
    child until its handler is the default again, then ends it as it would without sddoctor."""
    if "sigterm_pipe" not in _installed:
        return
    try:
        _installed["fork_mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    except (ValueError, OSError):
        pass


def _unblock_sigterm_after_fork() -> None:
    """The forking thread's signal mask as it was before the fork (parent and child)."""
    mask = _installed.pop("fork_mask", None)
    if mask is not None:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        except (ValueError, OSError):
            pass


def _forget_sigterm_in_child() -> None:
    """In a process forked from the rank (a `multiprocessing.Pool` or DataLoader worker): SIGTERM
    as it was before sddoctor, and no wakeup pipe. The watcher thread is not in the child, but the
    pipe is shared: a worker's SIGTERM (`Pool.__exit__` terminates its workers) would otherwise be
    read by the rank's watcher as the rank's own and end the healthy rank."""
    pipe = _installed.pop("sigterm_pipe", None)
    if pipe is None:
        _unblock_sigterm_after_fork()
        return
    read_fd, write_fd, previous = pipe
    try:
        if signal.getsignal(signal.SIGTERM) is _installed.get("sigterm"):
            signal.signal(signal.SIGTERM, previous)
        old_fd = signal.set_wakeup_fd(-1)
        if old_fd not in (-1, write_fd):  # the program's own, set after ours: keep it
            signal.set_wakeup_fd(old_fd)
    except (ValueError, OSError, TypeError):
        pass
    for fd in (read_fd, write_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    _installed.pop("sigterm", None)  # the child may install its own if it becomes a rank
    _unblock_sigterm_after_fork()  # a SIGTERM that came meanwhile is delivered now, to the child


def _watch_signals(
    read_fd: int, handled: threading.Event, default_action: bool, ours: Callable[..., Any], grace: float
) -> None:
    while True:
        try:
            select.select([read_fd], [], [])
            data = os.read(read_fd, 64)
        except (OSError, ValueError):
            return
        if signal.SIGTERM not in data:
            continue
        if not default_action or signal.getsignal(signal.SIGTERM) is not ours:
            _flush(None, 0)  # someone else's handler runs in the main thread and decides
            continue
        deadline = time.monotonic() + grace  # counted from the signal: the flush is bounded but may wait
        _note_signal_position(_main_thread_frame())  # stuck in native code, it has no Python handler yet
        _flush("signal", 128 + signal.SIGTERM)
        while time.monotonic() < deadline and not handled.is_set():
            time.sleep(0.05)
        if not handled.is_set():  # the main thread is stuck in native code
            _die_by_default_sigterm()
            return


def _die_by_default_sigterm() -> None:
    """Restore SIGTERM's default action from a non-main thread (signal.signal cannot) and re-send it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    except Exception:  # noqa: BLE001
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _own_session() -> Any:
    """The rank's session, or None in a process forked from the rank (a multiprocessing or
    DataLoader worker inherits the session object, but its exceptions, exits and signals are not
    the rank's)."""
    session = _installed.get("session")
    if session is None or getattr(session, "pid", None) != os.getpid():
        return None
    return session


def _flush(status: str | None, code: int) -> None:
    """Write what is buffered; with a `status`, the `exit` event too (the process is about to die)."""
    session = _own_session()
    if session is None:
        return
    try:
        if status is None:
            session.writer.flush(timeout=EXIT_FLUSH_TIMEOUT)
        else:
            session.exit_now(status, code)
    except Exception:  # noqa: BLE001
        pass
