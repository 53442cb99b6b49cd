"""What can be read off the launcher command, and the environment the job gets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sddoctor.telemetry.layout import RUN_DIR_ENV

_LAUNCHER_NAMES = ("torchrun", "accelerate", "torch.distributed.run", "torch.distributed.launch", "deepspeed")


def launcher_kind(command: list[str]) -> str:
    """'torchrun', 'accelerate', 'python' (a script: its processes become ranks when they join a
    process group; it may start them itself with mp.spawn) or 'other'."""
    words = [os.path.basename(w) for w in command[:4]]
    if "accelerate" in words:
        return "accelerate"
    if "torchrun" in words or any(
        w in ("torch.distributed.run", "torch.distributed.launch") for w in command[:4]
    ):
        return "torchrun"
    if words and words[0].startswith("python"):
        return "python"
    return "other"  # a shell script or another launcher: ranks are found by their environment


def _option(command: list[str], *names: str) -> str | None:
    for i, word in enumerate(command):
        for name in names:
            if word == name and i + 1 < len(command):
                return command[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def _launcher_args(command: list[str]) -> list[str]:
    """The launcher's own arguments (before the script), so a script's --nnodes is not misread."""
    out: list[str] = []
    for word in command:
        after_python = bool(out) and os.path.basename(out[-1]).startswith("python")
        if word.endswith(".py") or (word == "-m" and out and not after_python):
            break
        out.append(word)
    return out


def world_size_hint(command: list[str]) -> int | None:
    """World size when the launcher's options say it (nproc x nnodes), else None."""
    kind = launcher_kind(command)
    args = _launcher_args(command)
    if kind == "python":
        return None  # learnt from the ranks: the script may start them itself (mp.spawn)
    if kind == "other":
        return None
    if kind == "accelerate":
        n = _option(args, "--num_processes", "--num-processes")
        return int(n) if n and n.isdigit() else None
    # torchrun takes each option it is not given from PET_<NAME> (a cluster's job script often sets
    # PET_NNODES and PET_NODE_RANK), so a world read from the command alone can be too small
    nproc = _option(args, "--nproc-per-node", "--nproc_per_node") or os.environ.get("PET_NPROC_PER_NODE")
    nnodes = _option(args, "--nnodes") or os.environ.get("PET_NNODES") or "1"
    low, _, high = nnodes.partition(":")
    if high and low == high:
        nnodes = low  # "2:2": elastic bounds that leave one size
    if nproc and nproc.isdigit() and nnodes.isdigit():
        return int(nproc) * int(nnodes)
    return None


def node_rank_hint(command: list[str]) -> int:
    args = _launcher_args(command)
    value = _option(args, "--node-rank", "--node_rank", "--machine_rank", "--machine-rank")
    if value is None and launcher_kind(command) == "torchrun":
        value = os.environ.get("PET_NODE_RANK")
    value = value or os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK")
    return int(value) if value and value.isdigit() else 0


def rank_env(run_dir: Path, base: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """The job's environment: run dir, bootstrap on PYTHONPATH, the rank-side variables.

    Returns (env, warning); the warning says why ranks will not be instrumented, if they will not.
    """
    env = dict(os.environ if base is None else base)
    env[RUN_DIR_ENV] = str(run_dir)
    env.setdefault("PYTHONUNBUFFERED", "1")
    warning: str | None = None
    try:
        from sddoctor.instrument import boot
    except ImportError as exc:
        warning = f"rank instrumentation unavailable ({exc}); only process-level diagnosis is possible"
    else:
        # It puts its bootstrap directory (and this sddoctor) first on PYTHONPATH.
        env.update({k: str(v) for k, v in boot.rank_environment(run_dir, env).items()})
        env.pop(boot.RANK_PID_ENV, None)  # started from inside a rank: this job's ranks are ranks
    if warning is not None:
        package_root = str(Path(__file__).resolve().parents[2])
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([package_root, *([old] if old else [])])
    env[RUN_DIR_ENV] = str(run_dir)
    return env, warning


def resolve_executable(command: list[str]) -> str | None:
    """The path of the launcher, or None if it cannot be found."""
    from shutil import which

    exe = command[0]
    if os.sep in exe:
        return exe if os.access(exe, os.X_OK) else None
    return which(exe) or (sys.executable if exe in ("python", "python3") else None)
