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
    assert v["location"] is None, v  # no line of the user's: torchrun's own store failed
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


def test_a_node_that_never_joins_torchruns_rendezvous_is_said_to_be_missing(tmp_path: Path) -> None:
    """--nnodes 2 with one node started: torchrun's c10d rendezvous times out before any rank."""
    with socket.socket() as probe:  # a free port for the rendezvous endpoint
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = torchrun(
        1,
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "missing-node",
        "--rdzv-conf",
        "join_timeout=3",
        str(CLIENTS / "loop_forms.py"),
    )
    res = run_supervised(tmp_path, job, options=("--startup-timeout", "60"), timeout=120)
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"], v["location"]) == ("crash", None, None), v
    assert v["details"]["known_error"]["code"] == "rendezvous_timeout", v
    assert v["summary"].endswith(
        "RendezvousTimeoutError; not every node joined torchrun's rendezvous in time"
    ), v
