"""The registry of live runs: entries written by a real `sddoctor run`, read and cleaned by
`sddoctor tui`; stale entries (a killed supervisor, a reused pid) ignored and deleted."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from instrument_fixtures import wait_for
from tui_fixtures import isolate_registry

from conftest import subprocess_env
from sddoctor.telemetry import registry


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    return isolate_registry(tmp_path, monkeypatch)


@pytest.fixture
def sleeper():
    """A live process that is not this one (its pid makes an entry that is alive)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def write_entry(directory: Path, pid: int, run_dir: Path, **fields) -> Path:
    """An entry as `announce` writes it, for a process other than this one."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = {
        "v": 1,
        "pid": pid,
        "pid_start": registry._process_start(pid),
        "host": socket.gethostname(),
        "run_dir": str(run_dir),
        "endpoint": None,
        "command": ["torchrun", "train.py"],
        "cwd": str(run_dir.parent),
        "started": time.time(),
        **fields,
    }
    path = directory / f"{entry['host']}-{pid}.json"
    path.write_text(json.dumps(entry))
    path.chmod(0o600)
    return path


def test_registry_dir_is_under_xdg_runtime_dir_else_the_cache(tmp_path):
    assert registry.registry_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "sddoctor" / "runs"
    assert registry.registry_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "sddoctor" / "runs"
    assert registry.registry_dir({}) == Path.home() / ".cache" / "sddoctor" / "runs"
    missing = tmp_path / "not-there"
    assert registry.registry_dir({"XDG_RUNTIME_DIR": str(missing)}) == Path.home() / ".cache/sddoctor/runs"


def test_announce_writes_a_private_entry_that_live_runs_lists_until_removed(runs_dir, tmp_path):
    run = tmp_path / "job" / "sddoctor-runs" / "run-1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"endpoint": "http://127.0.0.1:8765", "started": 1000.0}))
    handle = registry.announce(run, ["torchrun", "--nproc-per-node", "2", "train.py"])
    assert handle.problem is None and handle.path is not None
    assert stat.S_IMODE(os.stat(runs_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(handle.path).st_mode) == 0o600
    [live] = registry.live_runs()
    assert live.pid == os.getpid() and live.run_dir == run.resolve() and live.label == "run-1"
    assert live.endpoint == "http://127.0.0.1:8765" and live.started == 1000.0
    assert live.command == ["torchrun", "--nproc-per-node", "2", "train.py"] and live.cwd == os.getcwd()
    assert registry.find_live_run(run).pid == os.getpid()
    handle.remove()
    handle.remove()  # twice is harmless
    assert registry.live_runs() == [] and not handle.path


def test_stale_entries_are_ignored_and_deleted_others_left_alone(runs_dir, tmp_path, sleeper):
    run = tmp_path / "run"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = write_entry(runs_dir, int(gone.stdout), run)
    reused = write_entry(runs_dir, sleeper.pid, run, pid_start=1)  # this pid started at another time
    other_host = write_entry(runs_dir, 999_999, run, host="another-node")  # a home shared over NFS
    alive = write_entry(runs_dir, os.getpid(), run)
    (runs_dir / "garbage.json").write_text("{not json")
    (runs_dir / "list.json").write_text("[1, 2]")
    (runs_dir / "link.json").symlink_to(alive)

    assert [r.entry for r in registry.live_runs(clean=False)] == [alive]
    assert dead.exists() and reused.exists()
    assert [r.entry for r in registry.live_runs()] == [alive]
    assert not dead.exists() and not reused.exists()
    assert other_host.exists() and alive.exists()


def test_entries_are_newest_first(runs_dir, tmp_path, sleeper):
    write_entry(runs_dir, sleeper.pid, tmp_path / "old", started=100.0)
    write_entry(runs_dir, os.getpid(), tmp_path / "new", started=200.0)
    assert [r.label for r in registry.live_runs()] == ["new", "old"]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_never_used(runs_dir, tmp_path):
    write_entry(runs_dir, os.getpid(), tmp_path / "run")
    os.chown(runs_dir, 65534, 65534)
    try:
        assert registry.live_runs() == []
        handle = registry.announce(tmp_path, ["x"])
        assert handle.path is None and "another user" in handle.problem
    finally:
        os.chown(runs_dir, 0, 0)


def test_a_loose_directory_is_made_private(runs_dir, tmp_path):
    runs_dir.mkdir(parents=True)
    runs_dir.chmod(0o777)
    registry.announce(tmp_path, ["x"]).remove()
    assert stat.S_IMODE(os.stat(runs_dir).st_mode) == 0o700


JOB = (
    "import pathlib, sys, time\nflag = pathlib.Path(sys.argv[1])\nwhile not flag.exists(): time.sleep(0.05)\n"
)


def _start_supervised(tmp_path, runs_dir, flag):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = subprocess_env(XDG_RUNTIME_DIR=str(runs_dir.parents[1]))
    cmd = [sys.executable, "-m", "sddoctor", "run", "--quiet", "--", sys.executable, "-c", JOB, str(flag)]
    return job_dir, subprocess.Popen(
        cmd, cwd=job_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def test_sddoctor_run_is_listed_while_it_runs_and_tui_opens_it(runs_dir, tmp_path):
    flag = tmp_path / "finish"
    job_dir, sup = _start_supervised(tmp_path, runs_dir, flag)
    try:
        [live] = wait_for(registry.live_runs, 60, "the live-run entry")
        assert live.pid == sup.pid and live.cwd == str(job_dir)
        assert live.run_dir.parent == job_dir / "sddoctor-runs" and live.endpoint.startswith(
            "http://127.0.0.1:"
        )
        assert live.command[1:3] == ["-c", JOB]
        # `sddoctor tui` with no argument, from another folder, finds it through the registry
        env = subprocess_env(XDG_RUNTIME_DIR=str(runs_dir.parents[1]))
        out = subprocess.run(
            [sys.executable, "-m", "sddoctor", "tui", "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["run"]["sources"] == [live.run_dir.name]
    finally:
        flag.touch()
        assert sup.wait(timeout=60) == 0, sup.stderr.read().decode()
        sup.stderr.close()
    assert registry.live_runs(clean=False) == [] and list(runs_dir.glob("*.json")) == []


def test_a_killed_supervisor_leaves_an_entry_the_next_reader_deletes(runs_dir, tmp_path):
    flag = tmp_path / "finish"
    _, sup = _start_supervised(tmp_path, runs_dir, flag)
    job = []
    try:
        [live] = wait_for(registry.live_runs, 60, "the live-run entry")
        job = wait_for(lambda: psutil.Process(sup.pid).children(recursive=True), 60, "the job")
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(timeout=30)
        assert live.entry.exists()  # nobody removed it...
        assert registry.live_runs() == [] and not live.entry.exists()  # ...the next reader does
    finally:
        flag.touch()  # the orphaned job ends by itself
        for proc in job:
            try:
                proc.wait(timeout=30)
            except psutil.NoSuchProcess:
                pass
        sup.stderr.close()
