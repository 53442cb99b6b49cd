"""The supervisor's parts on real files, processes and sockets: watcher, HTTP, py-spy, process tree."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sddoctor.codepaths import current_roots
from sddoctor.supervise import stacks
from sddoctor.supervise.launch import launcher_kind, node_rank_hint, world_size_hint
from sddoctor.supervise.procs import Job
from sddoctor.supervise.watch import Watcher
from sddoctor.telemetry import RunDir, TelemetryWriter
from sddoctor.telemetry.runinfo import RunOptions


def _writer(run_dir: RunDir, rank: int) -> TelemetryWriter:
    return TelemetryWriter(run_dir, rank, start_thread=False)


def test_watcher_sightings_progress_and_exit(tmp_path):
    rd = RunDir(tmp_path).ensure()
    w0 = _writer(rd, 0)
    watcher = Watcher(rd, options=RunOptions(hang_timeout=5, straggler_ratio=2), started=100.0)
    done = {
        "pg": "0",
        "seq": 3,
        "op": "all_reduce",
        "shapes": [[4]],
        "caller": "a.py:1",
        "t": 110.0,
        "duration": 0.5,
    }
    w0.update_state(collectives={"inflight": [], "issued": {"0": 3}, "last_done": done})
    w0.flush()
    watcher.poll(now=111.0)
    assert watcher.last_progress == 111.0
    arrival = watcher.ranks[0].arrivals["0"][3]
    assert (arrival.enqueue, arrival.duration, arrival.caller) == (109.5, 0.5, "a.py:1")
    # The same progress state again is no progress, however often the snapshot is rewritten.
    w0.flush()
    watcher.poll(now=115.0)
    assert watcher.last_progress == 111.0
    inflight = {"pg": "0", "seq": 4, "op": "all_reduce", "shapes": [[4]], "caller": "a.py:1", "since": 116.0}
    w0.update_state(collectives={"inflight": [inflight], "issued": {"0": 4}, "last_done": done})
    w0.emit("exit", status="signal", code=128 + 15)
    w0.flush()
    watcher.poll(now=117.0)
    assert watcher.last_progress == 117.0
    assert watcher.ranks[0].exit["signal"] == 15
    assert watcher.state(now=130.0).stalled_for == 13.0


PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def _start_waiting_script(tmp_path) -> tuple[Path, subprocess.Popen]:
    """A Python process asleep in `wait()` (line 4 of its script), once py-spy can read it."""
    if stacks.py_spy_path() is None or stacks.ptrace_problem():
        pytest.skip(f"py-spy cannot attach here: {stacks.ptrace_problem()}")
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\ndef wait():\n    time.sleep(60)\n\nwait()\n")
    return script, subprocess.Popen([sys.executable, str(script)])


def test_py_spy_dump_finds_the_user_frame(tmp_path):
    script, proc = _start_waiting_script(tmp_path)
    try:
        time.sleep(1.0)
        result = stacks.dump_stacks({3: proc.pid}, tmp_path / "stacks", timeout=20)[3]
    finally:
        proc.kill()
        proc.wait()
    assert result["ok"], result
    assert result["top_user_frame"] == f"{script}:4"
    assert (tmp_path / "stacks" / "rank-00003.json").exists()


def test_a_stopped_process_is_read_without_being_resumed(tmp_path):
    """A process stopped by SIGSTOP (Ctrl-Z, a debugger) is read without attaching: its stack is
    saved and marked, and it is still stopped afterwards (a SIGCONT would change what the user
    or their debugger set)."""
    script, proc = _start_waiting_script(tmp_path)
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        result = stacks.dump_stacks({2: proc.pid}, tmp_path / "stacks", timeout=20)[2]
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    finally:
        proc.kill()
        proc.wait()
    assert result["ok"] and result["stopped"], result
    assert result["top_user_frame"] == f"{script}:4"
    assert not result.get("main_holds_gil")  # time.sleep releases it


def test_a_process_a_tracer_holds_is_read_without_attaching(tmp_path):
    """A process that a debugger (gdb, strace) has stopped (state t) cannot be attached again: it
    is read without attaching, marked `traced`, and stays held. The tracer here is this test."""
    script, proc = _start_waiting_script(tmp_path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    try:
        time.sleep(1.0)
        if libc.ptrace(PTRACE_ATTACH, proc.pid, None, None) != 0:
            pytest.skip(f"ptrace(PTRACE_ATTACH) failed: {os.strerror(ctypes.get_errno())}")
        os.waitpid(proc.pid, 0)  # the tracee's stop
        assert stacks._process_state(proc.pid) == "t"
        result = stacks.dump_stacks({2: proc.pid}, tmp_path / "stacks", timeout=20)[2]
        assert stacks._process_state(proc.pid) == "t"
        libc.ptrace(PTRACE_DETACH, proc.pid, None, None)
    finally:
        proc.kill()
        proc.wait()
    assert result["ok"] and result["traced"] and not result.get("stopped"), result
    assert result["top_user_frame"] == f"{script}:4"


def test_a_dump_that_caught_the_process_mid_change_is_read_again(tmp_path):
    """py-spy's "Failed to get stack traces" (its read caught a thread starting or ending) is
    transient: the dump is taken again rather than leave the hang's culprit without a stack.
    The first call of this py-spy fails so; the next ones are the real py-spy."""
    script, proc = _start_waiting_script(tmp_path)
    real = stacks.py_spy_path()
    flaky = tmp_path / "py-spy"
    flaky.write_text(
        "#!/bin/sh\n"
        f'if [ ! -e "{tmp_path}/failed-once" ]; then touch "{tmp_path}/failed-once"; '
        'echo "Error: Failed to get stack traces" >&2; exit 1; fi\n'
        f'exec "{real}" "$@"\n'
    )
    flaky.chmod(0o755)
    (tmp_path / "stacks").mkdir()
    try:
        time.sleep(1.0)
        result = stacks._dump_one(
            str(flaky), 3, proc.pid, tmp_path / "stacks", 20.0, False, stacks.current_roots()
        )
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / "failed-once").exists()
    assert result["ok"] and result["top_user_frame"] == f"{script}:4", result


def test_py_spy_failure_is_explained_and_the_target_resumed(tmp_path):
    text = stacks.explain_failure("Error: Permission denied (os error 13)")
    assert "ptrace not permitted" in text and "SYS_PTRACE" in text and "ptrace_scope" in text
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        stacks._resume(proc.pid)
        time.sleep(0.2)
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
    finally:
        proc.kill()
        proc.wait()


def test_kill_tree_reaches_stubborn_and_escaped_descendants(tmp_path):
    # The launcher starts a child that ignores SIGTERM and leaves the process group.
    child = (
        "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(os.getpid(), flush=True); time.sleep(60)"
    )
    launcher = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    )
    job = Job(command=[sys.executable, "-c", launcher], env=dict(os.environ), run_dir=str(tmp_path))
    job.start(stderr_sink=open(os.devnull, "w"))  # noqa: SIM115
    deadline = time.monotonic() + 20
    while len(job.descendants) < 2 and time.monotonic() < deadline:
        job.refresh()
        time.sleep(0.1)
    procs = list(job.descendants.values())
    assert len(procs) >= 2
    escaped = [p for p in procs if p.pid != job.pid]
    while time.monotonic() < deadline and os.getsid(escaped[0].pid) != escaped[0].pid:
        time.sleep(0.05)
    time.sleep(0.5)  # let it install its SIGTERM handler
    start = time.monotonic()
    job.kill_tree(grace=1.0)
    assert 1.0 <= time.monotonic() - start < 10  # it waited out the grace period, then SIGKILL
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert job.exit_code is not None


@pytest.mark.parametrize(
    ("command", "kind", "world", "node"),
    [
        (["torchrun", "--nproc-per-node", "4", "train.py", "--nnodes", "9"], "torchrun", 4, 0),
        (
            ["torchrun", "--nnodes=2", "--node-rank=1", "--nproc_per_node=8", "-m", "trainer"],
            "torchrun",
            16,
            1,
        ),
        (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], "torchrun", 2, 0),
        (["accelerate", "launch", "--num_processes", "3", "t.py"], "accelerate", 3, 0),
        (["python", "t.py"], "python", None, 0),
        (["bash", "launch.sh"], "other", None, 0),
    ],
)
def test_launcher_hints(command, kind, world, node):
    assert launcher_kind(command) == kind
    assert world_size_hint(command) == world
    assert node_rank_hint(command) == node


@pytest.mark.parametrize(
    "argv", [["run", "--help"], ["report", "--help"], ["report", "/nonexistent-run-dir"]]
)
def test_run_and_report_do_not_import_torch(argv):
    from conftest import main_without_torch

    out = main_without_torch("sddoctor.cli", argv)
    assert out.returncode in (0, 2), out.stderr
    assert "torch imported" not in out.stderr and "Traceback" not in out.stderr


def test_a_stack_without_user_code_has_no_top_frame_of_torch_or_sddoctor() -> None:
    """A rank held by a skip fault at exit runs only sddoctor's atexit callback: its location
    falls back to the fault's call, never to a line of sddoctor's own."""
    roots = current_roots()
    internal = roots.internal[0]
    held = {"frames": [{"filename": f"{internal}/instrument/tracing.py", "line": 601, "name": "_hold"}]}
    assert stacks.top_user_frame(held, roots) is None
    library = roots.library[0]
    lightning = {
        "frames": [*held["frames"], {"filename": f"{library}/lightning/fit.py", "line": 3, "name": "fit"}]
    }
    assert stacks.top_user_frame(lightning, roots) == (f"{library}/lightning/fit.py:3", "fit")
