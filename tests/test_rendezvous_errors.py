"""A rendezvous port another process holds, in real runs under `sddoctor run`: the crash says which
process holds the port and what to do, whether torchrun's own store fails before any rank starts
or rank 0 of an mp.spawn job fails in `init_process_group`."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import run_supervised, script_line, torchrun

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port this test process listens on, as a rank of an earlier run that still lives would."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def _port_in_use(verdict: dict, port: int) -> None:
    found = verdict["details"]["known_error"]
    assert (found["code"], found["port"], found["holder"]["pid"]) == ("port_in_use", port, os.getpid()), found
    assert f"; port {port} is held by pid {os.getpid()} (" in verdict["summary"], verdict["summary"]
    assert any(f"stop it: `kill {os.getpid()}`" in line for line in verdict["evidence"]), verdict


def test_torchrun_whose_store_port_is_taken_is_told_who_holds_it(tmp_path: Path, held_port: int) -> None:
    job = torchrun(
        2, "--master-addr", "127.0.0.1", "--master-port", str(held_port), str(CLIENTS / "loop_forms.py")
    )
    res = run_supervised(tmp_path, job, options=("--startup-timeout", "60"), timeout=120)
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert v["kind"] == "crash" and v["culprit_rank"] is None, v
    # the launcher's error, not a line of the message, and no frame of torchrun's own script
    assert "the job exited with code 1: torch.distributed.DistNetworkError: " in v["summary"], v
    assert v["location"] is None or "/bin/" not in v["location"], v
    assert v["details"]["traceback"][-1].startswith("torch.distributed.DistNetworkError"), v
    _port_in_use(v, held_port)


def test_a_spawned_rank_that_cannot_listen_on_master_port_is_told_who_holds_it(
    tmp_path: Path, held_port: int
) -> None:
    script = CLIENTS / "spawn_tutorial.py"
    res = run_supervised(
        tmp_path,
        [sys.executable, str(script)],
        options=("--startup-timeout", "60", "--hang-timeout", "20", "--on-hang", "kill"),
        env={"MASTER_PORT": str(held_port), "OMP_NUM_THREADS": "1"},
        timeout=150,
    )
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert v["kind"] == "crash" and v["location"] == script_line("# INIT", script), v
    assert "EADDRINUSE" in v["summary"], v
    _port_in_use(v, held_port)
