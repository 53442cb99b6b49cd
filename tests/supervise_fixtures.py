"""Helpers for end-to-end tests of `sddoctor run`: run it on a real job and check nothing survives.

`run_supervised(job_command, ...)` is parametrized by the job command, so the same checks run on
a plain user script, the bundled trainer, or anything else.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from conftest import REPO_ROOT, subprocess_env

SCRIPT = REPO_ROOT / "tests" / "supervise_script.py"

Result = TypeVar("Result")


def script_line(marker: str, script: Path = SCRIPT) -> str:
    """'path:line' of the line of `script` that contains `marker`."""
    for number, line in enumerate(script.read_text().splitlines(), start=1):
        if marker in line:
            return f"{script}:{number}"
    raise AssertionError(f"{marker!r} not in {script}")


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *args]


@dataclass
class Supervised:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    seen_pids: set[int] = field(default_factory=set)

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "report.json").read_text())

    def events(self, rank: int, kind: str) -> list[dict[str, Any]]:
        """The rank's telemetry events of one kind, in order."""
        log = self.run_dir / "ranks" / f"rank-{rank:05d}.jsonl"
        return [e for e in map(json.loads, log.read_text().splitlines()) if e.get("kind") == kind]

    def verdicts(self, kind_prefix: str = "") -> list[dict[str, Any]]:
        return [v for v in self.report["verdicts"] if v["kind"].startswith(kind_prefix)]


def run_supervised(
    tmp_path: Path,
    job: list[str],
    *,
    options: tuple[str, ...] = ("--hang-timeout", "4", "--on-hang", "kill"),
    fault: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 90.0,
    interrupt_when_ranks: int | None = None,
    interrupt_when_file: Path | None = None,
    stop_signal: int = signal.SIGINT,
) -> Supervised:
    """Run `sddoctor run OPTIONS -- JOB`; fail if any process it started outlives it.

    With `interrupt_when_ranks=N`, send `stop_signal` (default SIGINT, Ctrl-C) once N ranks have
    written a state snapshot; with `interrupt_when_file`, once that file exists.
    """
    run_dir = tmp_path / "run"
    extra = dict(env or {})
    if fault:
        extra["SDDOCTOR_FAULT"] = fault
    cmd = [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(run_dir), *options, "--", *job]
    out_file, err_file = tmp_path / "sddoctor.stdout", tmp_path / "sddoctor.stderr"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, env=subprocess_env(**extra), stdout=out, stderr=err, cwd=tmp_path)
    tree = ProcessTree([proc])
    deadline = time.monotonic() + timeout
    interrupted = False
    try:
        while proc.poll() is None:
            tree.note_descendants()
            if interrupt_when_ranks and not interrupted:
                if len(list((run_dir / "ranks").glob("*.state"))) >= interrupt_when_ranks:
                    proc.send_signal(stop_signal)
                    interrupted = True
            if interrupt_when_file is not None and not interrupted and interrupt_when_file.exists():
                proc.send_signal(stop_signal)
                interrupted = True
            if time.monotonic() > deadline:
                raise AssertionError(f"sddoctor run did not finish in {timeout} s: {cmd}")
            time.sleep(0.1)
    finally:
        survivors = tree.end()
    assert not survivors, f"processes outlived sddoctor run: {[p.pid for p in survivors]}"
    return Supervised(proc.returncode, out_file.read_text(), err_file.read_text(), run_dir, set(tree.seen))


def run_side_by_side(
    root: Path, names: Iterable[str], run_one: Callable[[str, Path], Result], workers: int = 2
) -> dict[str, Result]:
    """`run_one(name, folder)` for each name, `workers` at a time, each in a folder of its own
    under `root`: a module's runs overlap their start-up and hang timeouts (the CI machine has 2
    cores, so more than 2-3 at once only slows each)."""

    def one(name: str) -> tuple[str, Result]:
        folder = root / name
        folder.mkdir()
        return name, run_one(name, folder)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, names))


def run_nodes(
    tmp_path: Path, nodes: dict[int, tuple[list[str], dict[str, str]]], timeout: float
) -> dict[int, int]:
    """Start one `sddoctor run` per node (node -> its command and environment, started in that
    order, logging to tmp_path/nodeN.log), wait for all; fail if one runs past `timeout` or any
    process they started outlives them. Returns each node's exit code."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    tree = ProcessTree([])
    try:
        for node, (cmd, env) in nodes.items():
            with open(tmp_path / f"node{node}.log", "w") as log:  # the child keeps its own copy
                procs[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=tmp_path)
            tree.procs.append(procs[node])
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs.values()):
            tree.note_descendants()
            if time.monotonic() > deadline:
                tails = {n: (tmp_path / f"node{n}.log").read_text()[-2000:] for n in procs}
                raise AssertionError(f"the nodes did not finish in {timeout} s: {tails}")
            time.sleep(0.1)
    finally:
        survivors = tree.end()
    assert not survivors, f"processes outlived sddoctor run: {[p.pid for p in survivors]}"
    return {node: p.returncode for node, p in procs.items()}


@dataclass
class ProcessTree:
    """Processes a test started and every descendant seen while they ran (a rank may be gone by
    the time its parent ends, so descendants are noted as the test waits, not at the end)."""

    procs: list[subprocess.Popen[Any]]
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def note_descendants(self) -> None:
        for proc in self.procs:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.Error:
                pass  # it ended meanwhile

    def end(self) -> list[psutil.Process]:
        """Kill the started processes still running (a test that failed or ran out of time), then
        every descendant still alive: returns those, which outlived their parent."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        survivors = [p for p in self.seen.values() if _alive(p)]
        for p in survivors:
            with contextlib.suppress(psutil.Error):  # it ended since
                p.kill()
        psutil.wait_procs(survivors, timeout=5)
        return survivors


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
