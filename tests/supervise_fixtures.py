"""Helpers for end-to-end tests of `sddoctor run`: run it on a real job and check nothing survives.

`run_supervised(job_command, ...)` is parametrized by the job command, so the same checks run on
a plain user script, the bundled trainer, or anything else.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from conftest import REPO_ROOT, subprocess_env

SCRIPT = REPO_ROOT / "tests" / "supervise_script.py"


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
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout
    interrupted = False
    try:
        me = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for child in me.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.Error:
                pass
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
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        survivors = [p for p in seen.values() if _alive(p)]
        for p in survivors:
            p.kill()
        psutil.wait_procs(survivors, timeout=5)
    assert not survivors, f"processes outlived sddoctor run: {[p.pid for p in survivors]}"
    return Supervised(proc.returncode, out_file.read_text(), err_file.read_text(), run_dir, set(seen))


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
