"""Zero-code-change instrumentation for `sddoctor run`.

The supervisor merges `rank_environment(run_dir)` into the job's environment. That puts
`bootstrap_dir()` on PYTHONPATH, so every Python process of the job imports our
`sitecustomize` at start-up. It calls `bootstrap()`, which, only in a rank process, starts
the rank session (telemetry, exception/SIGTERM hooks) and arranges for torch.distributed to be
traced the moment it is imported, before the user's script can bind its functions.

A process of the job that is not a launcher (torchrun, python -m torch.distributed.run,
accelerate launch) and that no ancestor rank has marked (SDDOCTOR_RANK_PID, set by a rank, tells its
DataLoader workers, compile workers and other children that they are not ranks) is instrumented:
- with RANK in its environment (a launcher started it) it is a rank from its first line on;
- without (an mp.spawn worker, a multiprocessing.Process, a plain script) it becomes a rank when it
  calls init_process_group, with the rank and world size of that call (`api.arm_on_init`). The
  parent that only spawns workers never joins a process group, so it is not a rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from sddoctor.instrument.flight_recorder import FR_BUFFER_ENV, TRACE_BUFFER_ENV, recorder_environment
from sddoctor.telemetry.layout import RUN_DIR_ENV

#: set by an enabled rank to its pid; children that inherit it are not ranks
RANK_PID_ENV = "SDDOCTOR_RANK_PID"
#: "0" turns the bootstrap off in a job that still has it on PYTHONPATH
BOOTSTRAP_ENV = "SDDOCTOR_BOOTSTRAP"

_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")
_LAUNCHER_PROGRAMS = ("torchrun", "accelerate", "accelerate-launch")


def bootstrap_dir() -> Path:
    """The directory to put first on PYTHONPATH: it holds only our sitecustomize.py."""
    return Path(__file__).resolve().parent / "bootstrap"


def rank_environment(
    run_dir: str | os.PathLike[str], environ: dict[str, str] | None = None
) -> dict[str, str]:
    """Variables the supervisor merges into the job's environment (before it starts).

    PYTHONPATH gets the bootstrap directory in front of what `environ` (default: os.environ)
    has, and the directory sddoctor is imported from at the end (so that a checkout works
    without installing, while the user's own entries keep their precedence; an installed
    sddoctor's site-packages is not added). NCCL flight recorder variables the user set
    already are kept.
    """
    env = os.environ if environ is None else environ
    first = str(bootstrap_dir())
    package_root = Path(__file__).resolve().parents[2]
    last = [] if package_root.name in ("site-packages", "dist-packages") else [str(package_root)]
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != first and p not in last]
    out = {
        RUN_DIR_ENV: str(Path(run_dir).resolve()),
        "PYTHONPATH": os.pathsep.join([first, *existing, *last]),
    }
    for key, value in recorder_environment(Path(run_dir).resolve()).items():
        out[key] = env.get(key) or value
    # One buffer size under both names: a user's value under either wins over our default.
    user_size = env.get(FR_BUFFER_ENV) or env.get(TRACE_BUFFER_ENV)
    if user_size:
        out[FR_BUFFER_ENV] = out[TRACE_BUFFER_ENV] = user_size
    return out


def is_rank_process(environ: Mapping[str, str] | None = None, argv: list[str] | None = None) -> bool:
    """Whether this process is a rank from its start (a launcher set RANK; see the module docstring)."""
    env = os.environ if environ is None else environ
    if not is_job_process(env, argv) or "RANK" not in env:
        return False
    # A multiprocessing child that inherited RANK is not that rank: it becomes one only if it
    # joins a process group itself.
    args = list(getattr(sys, "orig_argv", sys.argv)) if argv is None else argv
    return not any(arg == "-c" and "multiprocessing" in nxt for arg, nxt in zip(args, args[1:], strict=False))


def is_job_process(environ: Mapping[str, str] | None = None, argv: list[str] | None = None) -> bool:
    """Whether this process is part of a supervised job, is no launcher and no child of a rank."""
    env = os.environ if environ is None else environ
    if env.get(BOOTSTRAP_ENV, "1") == "0" or not env.get(RUN_DIR_ENV):
        return False
    owner = env.get(RANK_PID_ENV)
    if owner and owner != str(os.getpid()):
        return False  # a child of a rank: DataLoader worker, compile worker, subprocess
    args = list(getattr(sys, "orig_argv", sys.argv)) if argv is None else argv
    if args and os.path.basename(args[0]) in _LAUNCHER_PROGRAMS:
        return False
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1] in _LAUNCHER_MODULES:
            return False
    if any(os.path.basename(a) in _LAUNCHER_PROGRAMS for a in args[1:2]):
        return False  # `python /path/to/torchrun ...`
    return True


def bootstrap() -> bool:
    """Instrument this process if it belongs to the job. True if it is a rank already."""
    if not is_job_process():
        return False
    from sddoctor.instrument import api, spawn
    from sddoctor.instrument.faults import FaultSpecError, faults_from_env

    try:
        faults_from_env()  # a bad SDDOCTOR_FAULT stops every process at once, ranks or not
    except FaultSpecError as exc:
        # site.py would swallow a raise: say it and exit as the supervisor does for usage errors
        print(f"sddoctor: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    from sddoctor.instrument.flight_recorder import drop_deprecated_names

    drop_deprecated_names(os.environ)
    spawn.install()
    if not is_rank_process():
        api.arm_on_init()
        return False
    os.environ[RANK_PID_ENV] = str(os.getpid())
    session = api.enable(trace=True, bootstrap=True)
    return session is not None
