"""benchmarks.host_syncs: counts each synchronizing call site with its stack, leaves other
warnings alone, and runs the real trainer, timing its steps (on CPU, where CUDA reports no sync)."""

from __future__ import annotations

import re
import sys
import warnings

import pytest

from benchmarks import host_syncs
from tests.conftest import run_to_end, subprocess_env

SYNC_MESSAGE = "called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)"


def read_loss_every_step(steps: int) -> None:
    for _ in range(steps):
        warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)


def test_each_sync_site_is_counted_with_its_stack_and_other_warnings_pass_through() -> None:
    passed: list[str] = []
    log = host_syncs.SyncLog(lambda message, *rest: passed.append(str(message)))
    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.showwarning = log.showwarning
        warnings.simplefilter("always")
        read_loss_every_step(3)
        warnings.warn("an unrelated deprecation", DeprecationWarning, stacklevel=1)
    assert passed == ["an unrelated deprecation"]
    assert len(log.sites) == 1
    ((site, count),) = log.sites.items()
    assert count == 3
    assert site[-1][2] == "read_loss_every_step"
    report = log.report()
    assert report[0] == "3 x called a synchronizing CUDA operation"
    assert any("test_host_syncs.py" in line and "read_loss_every_step" in line for line in report)


@pytest.mark.slow
def test_runs_the_trainer_and_times_each_step_from_the_chosen_one(tmp_path) -> None:
    code, out = run_to_end(
        [
            sys.executable,
            "-m",
            "benchmarks.host_syncs",
            "--after",
            "3",
            "--",
            "--set",
            "train.max_steps=7",
            "train.log_every=7",
            "data.max_samples=64",
            "--output-dir",
            str(tmp_path / "run"),
            "--quiet",
        ],
        timeout=300,
        env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert code == 0, out
    times = re.search(r"host ms between step starts, from step 3: \[(.*)\]", out)
    assert times, out
    # steps 3..7 start five times: four intervals between them
    assert len([t for t in times.group(1).split(",") if float(t) > 0]) == 4
    assert "no CUDA device: synchronizing calls are not reported" in out


def test_bad_arguments_exit_2() -> None:
    code, out = run_to_end(
        [sys.executable, "-m", "benchmarks.host_syncs", "--after", "0"], timeout=60, env=subprocess_env()
    )
    assert code == 2
    assert "--after must be at least 1" in out
