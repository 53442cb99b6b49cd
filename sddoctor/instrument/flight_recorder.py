"""PyTorch's NCCL flight recorder: switched on through the environment, dumped through a pipe.

The recorder keeps the last N collectives of every NCCL process group. N comes from
TORCH_FR_BUFFER_SIZE (torch 2.13 names it so and warns that the older TORCH_NCCL_TRACE_BUFFER_SIZE
is deprecated) or TORCH_NCCL_TRACE_BUFFER_SIZE (the only name older builds such as 2.11 know, and
the one the dump pipe is sized from), so both are set. With TORCH_NCCL_DEBUG_INFO_PIPE_FILE set,
each rank's watchdog creates a FIFO named `<prefix><rank>.pipe` (torch's DumpPipe); writing to it
makes that rank dump its buffer (a pickle) to `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`. These variables must be in the environment before
the process group is created, so `sddoctor run` puts them into the job's environment
(`sddoctor.instrument.boot.rank_environment`). gloo has no flight recorder worth reading
(entries stay "scheduled"), so dumping is a no-op there.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

TRACE_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DUMP_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
PIPE_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
# The dump leaves out Python stack traces: sddoctor takes every rank's stack with py-spy, and the
# watchdog thread that writes the dump needs the GIL to symbolize Python frames, which PyTorch
# documents can deadlock. (A rank whose collectives sddoctor traces was seen to die of SIGSEGV a
# few seconds after its dump on torch 2.11 / H200, and still does with this off: that crash has
# another cause, see tests/test_instrument_cuda.py.) A user's value wins.
STACK_TRACE_ENV = "TORCH_INCLUDE_STACK_TRACE"
TRACE_PREFIX = "nccl_trace_rank_"
PIPE_PREFIX = "nccl_pipe_rank_"


def recorder_environment(run_dir: str | os.PathLike[str], buffer_size: int = 2000) -> dict[str, str]:
    """The variables that switch the recorder on, with dumps and pipes under RUN_DIR/stacks/.

    Creates RUN_DIR/stacks/: ProcessGroupNCCL's watchdog aborts the whole rank process (SIGABRT)
    when the pipe's directory does not exist, so the folder must be there before any rank starts.
    """
    stacks = Path(run_dir) / "stacks"
    stacks.mkdir(parents=True, exist_ok=True)
    return {
        FR_BUFFER_ENV: str(buffer_size),
        TRACE_BUFFER_ENV: str(buffer_size),
        DUMP_FILE_ENV: str(stacks / TRACE_PREFIX),
        PIPE_FILE_ENV: str(stacks / PIPE_PREFIX),
        STACK_TRACE_ENV: "0",
    }


def drop_deprecated_names(environ: dict[str, str] | os._Environ[str]) -> None:
    """Rank side, before torch is imported: keep only the buffer-size name the installed torch reads
    without a deprecation warning (TORCH_FR_BUFFER_SIZE: torch 2.11 on an H200 already warned about
    the old name), unless the user set the old name to another value."""
    if environ.get(TRACE_BUFFER_ENV) is None or environ.get(TRACE_BUFFER_ENV) != environ.get(FR_BUFFER_ENV):
        return
    found = _installed_torch_version()
    if found is not None and found >= (2, 11):
        del environ[TRACE_BUFFER_ENV]


def _installed_torch_version() -> tuple[int, int] | None:
    """(major, minor) from the name of torch's dist-info folder, without importing torch or scanning
    every installed distribution (this runs at the start of every process of a job)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return None
        for info in Path(spec.origin).parent.parent.glob("torch-*.dist-info"):
            major, minor = (int(part) for part in info.name[len("torch-") :].split(".")[:2])
            return major, minor
    except (ImportError, ValueError, OSError):
        return None
    return None


def trigger_dump(pipe_prefix: str | os.PathLike[str], rank: int) -> bool:
    """Ask rank `rank` to dump its recorder by writing to its pipe. Never blocks.

    Usable from any process (the supervisor included). False when there is no pipe or nobody
    reads it (not NCCL, recorder off, rank gone).
    """
    try:
        fd = os.open(pipe_path(pipe_prefix, rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT, errno.EACCES, errno.ENOTDIR):
            return False  # no pipe, or nobody reads it
        raise
    try:
        os.write(fd, b"1\n")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def pipe_path(pipe_prefix: str | os.PathLike[str], rank: int) -> str:
    """The FIFO torch's DumpPipe creates for `rank`: `<prefix><rank>.pipe`."""
    return f"{pipe_prefix}{rank}.pipe"


def dump_flight_recorder() -> bool:
    """Rank side: dump this rank's NCCL flight recorder now. False (a no-op) unless on NCCL."""
    prefix = os.environ.get(PIPE_FILE_ENV)
    if not prefix:
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if "nccl" not in (default_backend() or ""):
        return False
    return trigger_dump(prefix, dist.get_rank())


def default_backend() -> str | None:
    """The default process group's backend as the program chose it, None without one.

    `init_process_group()` with no backend leaves torch's name for it "undefined" and gives the
    group one backend per device type: its config ("cpu:gloo,cuda:nccl") is the name then, so that
    an NCCL group started that way is still seen as NCCL.
    """
    import torch.distributed as dist

    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        backend = str(dist.get_backend())
        if backend == "undefined":
            backend = str(dist.get_backend_config())
        return backend
    except Exception:  # noqa: BLE001 - a torch without get_backend_config, a group torn down meanwhile
        return None


def dump_files(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """Flight recorder dumps present in RUN_DIR/stacks/, by rank."""
    found: dict[int, Path] = {}
    stacks = Path(run_dir) / "stacks"
    if not stacks.is_dir():
        return found
    for entry in stacks.iterdir():
        if entry.name.startswith(TRACE_PREFIX) and entry.name[len(TRACE_PREFIX) :].isdigit():
            found[int(entry.name[len(TRACE_PREFIX) :])] = entry
    return found
