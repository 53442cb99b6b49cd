"""sddoctor's record of its own failures inside a rank (`sddoctor.instrument.safety`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from sddoctor.instrument import safety


class _Handler:
    """A program's signal handler as an object (Lightning installs one for SIGTERM)."""

    def __call__(self, signum, frame):
        raise RuntimeError("Connection closed by peer")


@pytest.fixture
def handler():
    previous = signal.signal(signal.SIGUSR1, _Handler())
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_an_error_a_signal_handler_raised_inside_sddoctor_is_not_sddoctors(handler, monkeypatch) -> None:
    recorded = []
    monkeypatch.setattr(safety, "_emit", lambda fields: recorded.append(fields) or True)
    try:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, as inside sddoctor's code
    except RuntimeError as exc:
        safety.internal_error("test: interrupted by a handler", exc)
    try:
        raise ValueError("sddoctor's own")
    except ValueError as exc:
        safety.internal_error("test: its own", exc)
    assert [f["where"] for f in recorded] == ["test: its own"]


FORK_SCRIPT = """
import os, signal, sys, time
# runs in the child before sddoctor's at-fork handlers (registered later): a SIGTERM that reaches
# a forked worker in that window, as Pool.terminate() can send to a worker it has just started
os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))
from sddoctor.instrument import api
api.enable(sys.argv[1], rank=0, world_size=1)
pid = os.fork()
if pid == 0:
    time.sleep(5)
    os._exit(0)  # not reached: the pending SIGTERM ends the child once it is unblocked
_, status = os.waitpid(pid, 0)
blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
time.sleep(2.5)  # longer than the watcher's grace: a byte in the rank's pipe would end it now
print("child", os.waitstatus_to_exitcode(status), "blocked", blocked, "alive", flush=True)
"""


def test_a_sigterm_that_reaches_a_forked_child_before_it_lets_go_of_the_ranks_pipe_ends_only_the_child(
    tmp_path,
) -> None:
    done = _run_rank_script(FORK_SCRIPT, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "-15", "blocked", "False", "alive"], done.stdout


SIGTERM_IN_FLUSH_SCRIPT = """
import os, signal, sys, time
from sddoctor.instrument import api
session = api.enable(sys.argv[1], rank=0, world_size=1)
session.writer.emit("warning", code="before", message="queued before the signal")
# torch's start_processes SIGTERMs the surviving ranks while one may be writing its own exception
# (the flush holds the writer's lock): the handler runs inside that flush, on the same thread
session.writer.add_state_provider(lambda: os.kill(os.getpid(), signal.SIGTERM) or {})
session.writer.flush()
time.sleep(10)
print("survived", flush=True)
"""


def test_a_sigterm_that_comes_while_the_rank_flushes_its_telemetry_ends_it_with_its_exit_recorded(
    tmp_path,
) -> None:
    started = time.monotonic()
    done = _run_rank_script(SIGTERM_IN_FLUSH_SCRIPT, tmp_path / "run")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert time.monotonic() - started < 8, "the signal waited for the flush it interrupted"
    events = [json.loads(line) for line in (tmp_path / "run" / "ranks" / "rank-00000.jsonl").open()]
    assert [e.get("code") for e in events if e["kind"] == "warning"] == ["before"], events
    assert [(e["status"], e["code"]) for e in events if e["kind"] == "exit"] == [("signal", 143)], events


STUCK_IN_NATIVE_SCRIPT = """
import os, signal, sys, threading
from datetime import timedelta
import torch.distributed as dist
from sddoctor.instrument import api
api.enable(sys.argv[1], rank=0, world_size=1)
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
def wait_for_peer():
    store.get("never-set")  # blocked in C++, which retries through the signal: no Python handler runs
wait_for_peer()
"""


def test_a_rank_stuck_in_native_code_when_sigterm_comes_records_where_it_was(tmp_path) -> None:
    """The rank's watcher thread ends it (its Python handler cannot run), and the exit event says
    where the main thread was: the line a launcher's SIGTERM found a stuck rank at."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_IN_NATIVE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    events = [json.loads(line) for line in (tmp_path / "run" / "ranks" / "rank-00000.jsonl").open()]
    (exit_event,) = [e for e in events if e["kind"] == "exit"]
    stuck, outer = f"{script}:10", f"{script}:11"
    assert (exit_event["status"], exit_event["at"], exit_event["at_function"]) == (
        "signal",
        stuck,
        "wait_for_peer",
    )
    assert exit_event["stack"] == [f"{outer} in <module>", f"{stuck} in wait_for_peer"], exit_event


def _run_rank_script(script: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter, with the run directory as its first argument."""
    return subprocess.run(
        [sys.executable, "-c", script, str(run_dir)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sigterms_second_reader_waits_until_the_exit_event_is_on_disk(tmp_path: Path) -> None:
    """SIGTERM reaches the watcher thread and the main thread's handler alike. The watcher's write of
    the exit event can still be under way when the handler, finding it claimed, would re-raise
    SIGTERM and end the process: the handler must wait for it (a rank asleep when torchrun stopped it
    was once left with no exit event and no line)."""
    import threading

    from sddoctor.instrument.api import RankSession
    from sddoctor.telemetry.layout import RunDir
    from sddoctor.telemetry.reader import read_events

    class SlowHeartbeat:  # the watcher's write takes a while: the collectives' last second first
        def flush_now(self) -> None:
            time.sleep(0.6)

        def close(self) -> None:
            pass

    session = RankSession(RunDir(tmp_path), 0, 0, 1, [])
    session.heartbeat = SlowHeartbeat()
    watcher = threading.Thread(target=session.exit_now, args=("signal", 143))
    watcher.start()
    time.sleep(0.1)  # the watcher is inside its write now
    session.exit_now("signal", 143)  # the main thread's handler; the process would die right after
    exits = read_events(tmp_path / "ranks" / "rank-00000.jsonl", {"exit"})
    assert [(e["status"], e["code"]) for e in exits] == [("signal", 143)], exits
    watcher.join()
    session.close()
    assert len(read_events(tmp_path / "ranks" / "rank-00000.jsonl", {"exit"})) == 1


def test_the_watcher_takes_the_frame_sigterms_handler_interrupted_not_the_handlers_own(monkeypatch) -> None:
    """The watcher thread reads the main thread's frame for the SIGTERM position. When the main
    thread is already inside sddoctor's handler (walking its own stack), the position is the frame
    the handler interrupted: a CI run once recorded linecache's line as the rank's stack."""
    import threading

    from sddoctor.instrument import exit_hooks

    seen: list = []
    inside = threading.Event()

    def handler(signum, frame):  # stands for on_sigterm: the watcher runs while it is busy
        inside.set()
        reader.join(5)

    def read_main_frame() -> None:
        inside.wait(5)
        seen.append(exit_hooks._main_thread_frame())

    monkeypatch.setitem(exit_hooks._installed, "sigterm", handler)
    reader = threading.Thread(target=read_main_frame)
    reader.start()
    interrupted = sys._getframe()
    handler(15, interrupted)  # the interrupted frame is this test's own
    assert seen and seen[0] is interrupted, seen
    assert exit_hooks.frame_position(seen[0])["at_function"] == (
        "test_the_watcher_takes_the_frame_sigterms_handler_interrupted_not_the_handlers_own"
    )
