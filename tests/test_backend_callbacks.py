"""Callbacks that sddoctor hands to gloo's threads, and the rank's exit, which waits until those
threads have dropped them (sddoctor/instrument/backend_callbacks.py).

A drop that comes after the interpreter ended takes the GIL there and aborts the process after a
run that succeeded. The real case is run first without sddoctor's wait (it aborts), then with a
rank session (it ends cleanly): torchrun, 2 gloo ranks, tests/clients/late_callback_drop.py.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
from client_fixtures import CLIENTS
from supervise_fixtures import torchrun

from conftest import run_to_end, subprocess_env
from sddoctor.instrument import backend_callbacks
from sddoctor.instrument.backend_callbacks import BackendCallback

ABORT = "terminate called without an active exception"


@pytest.mark.timeout(180)
def test_a_rank_waits_at_exit_for_gloo_to_drop_its_callbacks(tmp_path: Path) -> None:
    command = torchrun(2, "--standalone", str(CLIENTS / "late_callback_drop.py"))
    # the hazard is real: the same program without the wait dies of SIGABRT after finishing. It
    # is a race (the drop against the interpreter's end), so one of three runs must show it
    for _ in range(3):
        code, bare = run_to_end(command, timeout=90, env=subprocess_env(MODE="bare"))
        if code != 0:
            break
    assert code != 0 and ABORT in bare, bare[-3000:]
    assert bare.count("done") >= 2, bare[-3000:]
    env = subprocess_env(MODE="session", RUN_DIR=str(tmp_path / "run"))
    code, session = run_to_end(command, timeout=90, env=env)
    assert code == 0, session[-3000:]
    assert ABORT not in session and session.count("done") == 2, session[-3000:]


def test_a_callback_is_counted_until_dropped() -> None:
    before = backend_callbacks.counts()
    callback = BackendCallback(lambda fut: fut * 2)
    assert backend_callbacks.counts() == (before[0] + 1, before[1])
    assert callback(21) == 42
    assert backend_callbacks.counts() == (before[0] + 1, before[1] + 1)
    del callback
    gc.collect()
    assert backend_callbacks.counts() == before


def test_the_wait_is_bounded_for_callbacks_held_or_never_run() -> None:
    before = backend_callbacks.counts()
    ran = BackendCallback(lambda fut: None)
    ran(None)
    started = time.monotonic()
    assert not backend_callbacks.wait_until_released(ran_timeout=0.2, pending_timeout=0.05)
    assert 0.2 <= time.monotonic() - started < 2.0  # one that ran is waited for longer
    del ran
    never_run = BackendCallback(lambda fut: None)
    started = time.monotonic()
    assert not backend_callbacks.wait_until_released(ran_timeout=0.2, pending_timeout=0.05)
    assert time.monotonic() - started < 0.2  # its future may never complete (a dead peer)
    del never_run
    assert backend_callbacks.counts() == before
