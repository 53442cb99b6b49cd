"""Helpers of the instrument tests: start real rank processes with the bootstrap on PYTHONPATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT, free_port, subprocess_env
from sddoctor.instrument.boot import rank_environment
from sddoctor.telemetry.reader import read_events, read_json

SCRIPT = Path(__file__).with_name("instrument_script.py")


def line_of(marker: str, script: Path = SCRIPT) -> str:
    """`file:line` of the line carrying `# @marker` in the test script."""
    for number, text in enumerate(script.read_text().splitlines(), start=1):
        if f"# @{marker}" in text:
            return f"{script}:{number}"
    raise KeyError(marker)


def rank_env(run_dir: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = subprocess_env()
    env.update(rank_environment(run_dir, env))
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env.update(extra)
    return env


def start_ranks(run_dir: Path, world: int, *args: str, fault: str | None = None) -> list[subprocess.Popen]:
    """`world` rank processes of instrument_script.py, as a launcher would start them."""
    port = free_port()
    extra = {"SDDOCTOR_FAULT": fault} if fault else {}
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=rank_env(run_dir, r, world, port, **extra),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]


def reap(procs: list[subprocess.Popen], sig: int = signal.SIGKILL) -> list[str]:
    """Kill what still runs and collect every output."""
    outs = []
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        outs.append(out or "")
    return outs


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def state(run_dir: Path, rank: int) -> dict[str, Any]:
    return read_json(run_dir / "ranks" / f"rank-{rank:05d}.state") or {}


def collectives(run_dir: Path, rank: int) -> dict[str, Any]:
    return state(run_dir, rank).get("collectives") or {}


def events(run_dir: Path, rank: int, kind: str | None = None) -> list[dict[str, Any]]:
    return read_events(run_dir / "ranks" / f"rank-{rank:05d}.jsonl", {kind} if kind else None)


def records(output: str) -> dict[str, dict[str, Any]]:
    """The `REC` lines the script printed in trace mode, by label."""
    out = {}
    for line in output.splitlines():
        if line.startswith("REC "):
            data = json.loads(line[4:])
            out[data["label"]] = data
    return out
