"""`sddoctor tui` as a command: --once/--json without NVML (this machine has no GPU, or a
fake says so), bad arguments, no torch import, and start-up time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from tui_fixtures import isolate_registry, serve_state

from conftest import subprocess_env
from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.tui import cli


@pytest.fixture(autouse=True)
def _no_live_runs(tmp_path, monkeypatch):
    isolate_registry(tmp_path, monkeypatch)


def _sddoctor(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "sddoctor", "tui", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=cwd,
        timeout=60,
    )


def test_json_without_nvml_still_reports_host_and_says_why(capsys):
    set_nvml_for_tests(None, "NVML could not start (Driver Not Loaded): no NVIDIA driver or GPU visible")
    try:
        assert cli.main(["--json", "--no-run"]) == 0
    finally:
        set_nvml_for_tests(None, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc["nvml"] == {
        "available": False,
        "driver_version": None,
        "note": "NVML could not start (Driver Not Loaded): no NVIDIA driver or GPU visible",
    }
    assert doc["gpus"] == [] and doc["host"]["memory_total"] > 0 and len(doc["host"]["load_average"]) == 3
    assert doc["alerts"][0]["kind"] == "gpu.none"


def test_once_finds_the_newest_run_and_imports_no_torch(tmp_path):
    for name, step in (("run-old", 1), ("run-new", 2)):
        ranks = tmp_path / "sddoctor-runs" / name / "ranks"
        ranks.mkdir(parents=True)
        (ranks / "rank-00000.state").write_text(
            json.dumps({"rank": 0, "pid": 1, "host": "elsewhere", "step": step})
        )
        time.sleep(0.02)
    code = (
        "import sys; from sddoctor.cli import main; rc = main(['tui', '--once']); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "import sddoctor.tui.app; assert 'torch' not in sys.modules, 'torch imported by the app'; sys.exit(rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "run: run-new" in out.stdout and "step 2" in out.stdout


def test_bad_arguments_exit_2_with_the_fix(tmp_path):
    cases = [
        (["--run-dir", str(tmp_path / "nope")], "no such directory"),
        (["--connect", "node1"], "expected HOST:PORT"),
        (["--connect", "node1:99999"], "expected HOST:PORT"),
        (["--interval", "0"], "must be a positive number"),
        (["--frobnicate"], "unrecognized arguments"),
    ]
    for args, words in cases:
        out = _sddoctor(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert words in out.stderr and "Traceback" not in out.stderr


def test_help_has_examples_and_exit_codes():
    out = _sddoctor("--help")
    assert (
        out.returncode == 0
        and "examples:" in out.stdout
        and "exit codes (one table for every sddoctor command" in out.stdout
    )


def test_json_snapshot_without_a_run_needs_neither_torch_nor_a_gpu():
    """The whole app module plus one --json snapshot in a fresh process (start-up time is measured by
    `python -m benchmarks.tui_cost`, not asserted here)."""
    code = (
        "import io, contextlib, json, sys; import sddoctor.tui.app, sddoctor.tui.cli as c; buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf): rc = c.main(['--json', '--no-run'])\n"
        "doc = json.loads(buf.getvalue()); assert 'torch' not in sys.modules; print(rc, sorted(doc))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 ")


def test_benchmark_runs_and_prints_its_table(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.tui_cost",
            "--seconds",
            "1",
            "--fake-gpus",
            "2",
            "--skip-app",
            "--json",
            str(tmp_path / "bench.json"),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "CPU % of a core, data layer at 1 Hz" in out.stdout and "fake (2 GPUs)" in out.stdout
    figures = json.loads((tmp_path / "bench.json").read_text())
    assert figures["gpus"] == 2 and figures["ours_1hz"]["samples"] >= 1
    assert 0 < figures["ours_tight"]["sample_ms_median"] < 50
    assert 0 < figures["ours_startup_to_first_frame_s"] < 10


def _node(rank: int, host: str) -> dict:
    state = {
        "rank": rank,
        "pid": 100 + rank,
        "host": host,
        "local_rank": 0,
        "world_size": 2,
        "step": 10,
        "last_step": {"step": 10, "loss": 0.5, "step_time": 0.5, "samples": 4, "t": 1.0},
    }
    return {
        "v": 1,
        "run": {},
        "node": {"host": host, "node_rank": rank},
        "ranks": {str(rank): state},
        "verdicts": [],
    }


def test_json_connects_to_several_nodes(capsys):
    set_nvml_for_tests(None, "no NVML in this test")
    try:
        with serve_state(_node(0, "node-a")) as a, serve_state(_node(1, "node-b")) as b:
            assert cli.main(["--json", "--connect", a, "--connect", b]) == 0
    finally:
        set_nvml_for_tests(None, None)
    doc = json.loads(capsys.readouterr().out)
    # each rank: 4 samples in a 0.5 s step, 8 img/s of its own; the job: 16
    assert doc["run"] == {"sources": [a, b], "errors": [], "images_s_total": 16.0}
    assert [(r["rank"], r["node"], r["host"], r["step"]) for r in doc["ranks"]] == [
        (0, a, "node-a", 10),
        (1, b, "node-b", 10),
    ]
