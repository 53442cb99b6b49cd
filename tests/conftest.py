"""Shared fixtures. Multi-rank tests run real processes on CPU with gloo."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that imports this checkout (not an installed copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("SDDOCTOR_FAULT", "SDDOCTOR_RUN_DIR"):
        env.pop(key, None)
    env.update(extra)
    return env


def run_to_end(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> tuple[int, str]:
    """Run `cmd` in its own session; (exit code, stdout+stderr). Past `timeout` its whole process
    group is killed and the test fails with the output's tail (a hang, not a slow machine, at
    the generous timeouts the callers give)."""
    return wait_to_end(start_in_session(cmd, env, cwd), timeout)


def start_in_session(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> subprocess.Popen[str]:
    """Start `cmd` in a session of its own (so that its whole process group can be killed), its
    stdout and stderr in one pipe, for a test that acts on it while it runs, then `wait_to_end`."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env if env is not None else subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_to_end(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """`run_to_end` for a process `start_in_session` started."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        cmd = proc.args if isinstance(proc.args, list) else [str(proc.args)]
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... did not finish in {timeout:.0f} s:\n{output[-3000:]}")
    return proc.returncode, output


def main_without_torch(module: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`module.main(argv)` in a fresh process, which fails with 'torch imported' on stderr when the
    command imported torch (the commands that must start without it: docs/architecture.md)."""
    code = (
        f"import sys; from {module} import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )


def two_rank_worker_results(source: str, out_dir: Path, timeout: float = 120) -> list[dict[str, Any]]:
    """Write `source` to OUT_DIR/worker.py, run it under torchrun with 2 ranks (argv[1] = OUT_DIR,
    where each rank writes rank{R}.json) and return what rank 0 and rank 1 wrote; fails the test
    with the job's stderr when it did not end with 0."""
    script = out_dir / "worker.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*cmd, str(script), str(out_dir)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_collecting(fn: Any, nprocs: int) -> dict[Any, Any]:
    """`torch.multiprocessing.spawn(fn, args=(port, results), nprocs=nprocs)` with a free port for
    the workers' process group; returns what they put into the shared dict `results`."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(fn, args=(free_port(), results), nprocs=nprocs)
        return dict(results)


@pytest.fixture
def python() -> str:
    return sys.executable
