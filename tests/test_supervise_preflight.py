"""`sddoctor run --preflight` (check-nccl before the launch) and the flight recorder's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env
from sddoctor.instrument.boot import rank_environment
from sddoctor.instrument.flight_recorder import recorder_environment, trigger_dump

# The job records that it ran, and whether the ranks were told to skip their own preflight.
JOB = [
    sys.executable,
    "-c",
    "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('SDDOCTOR_PREFLIGHT', '-'))",
]


def _sddoctor(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sddoctor", *args],
        cwd=tmp_path,
        env=subprocess_env(OMP_NUM_THREADS="1", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_failing_preflight_stops_the_launch_unless_told_to_continue(tmp_path):
    run_dir, marker = tmp_path / "stopped", tmp_path / "ran"
    bad = {"NCCL_SOCKET_IFNAME": "nosuch0"}  # an interface that does not exist: a `fail` finding
    res = _sddoctor(tmp_path, "run", "--preflight", "--run-dir", str(run_dir), "--", *JOB, str(marker), **bad)
    assert res.returncode == 4, res.stderr
    assert not marker.exists()  # nothing was launched
    assert "nccl.env.ifname_missing" in res.stderr and "--preflight-continue" in res.stderr
    saved = json.loads((run_dir / "preflight.json").read_text())
    assert saved["worst"] == "fail"
    assert "nccl.env.ifname_missing" in [f["id"] for f in saved["findings"]]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["outcome"] == "preflight_failed" and report["preflight"]["worst"] == "fail"
    again = _sddoctor(tmp_path, "report", str(run_dir))
    assert again.returncode == 1 and "not launched" in again.stdout

    run_dir = tmp_path / "continued"
    res = _sddoctor(
        tmp_path,
        "run",
        "--preflight",
        "--preflight-continue",
        "--run-dir",
        str(run_dir),
        "--",
        *JOB,
        str(marker),
        **bad,
    )
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "0"  # ran, and told the ranks that the preflight is done
    report = json.loads((run_dir / "report.json").read_text())
    assert report["outcome"] == "ok" and report["preflight"]["worst"] == "fail"
    assert "## Preflight" in (run_dir / "report.md").read_text()
    assert "preflight: fail nccl.env.ifname_missing" in res.stderr


def test_flight_recorder_buffer_is_set_under_both_names(tmp_path):
    env = recorder_environment(tmp_path)
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    # A user's size under either name wins, under both names.
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env = rank_environment(tmp_path, {name: "64"})
        assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"


def test_dump_is_asked_through_torchs_pipe_name_only(tmp_path):
    prefix = tmp_path / "nccl_pipe_rank_"
    os.mkfifo(f"{prefix}0")  # not the name torch's DumpPipe uses: never written
    fd = os.open(f"{prefix}0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert trigger_dump(prefix, 0) is False
    finally:
        os.close(fd)
    os.mkfifo(f"{prefix}0.pipe")
    fd = os.open(f"{prefix}0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert trigger_dump(prefix, 0) is True
        assert os.read(fd, 8) == b"1\n"
    finally:
        os.close(fd)
