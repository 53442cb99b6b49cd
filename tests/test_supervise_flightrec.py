"""Flight Recorder dumps are data, never code: what `sddoctor run` reads from the dump prefix."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from sddoctor.instrument.flight_recorder import recorder_environment
from sddoctor.supervise import flightrec
from sddoctor.telemetry import RunDir


class _Payload:
    """What an attacker plants: unpickling it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run(tmp_path: Path, started: float | None = None) -> tuple[RunDir, dict[str, str]]:
    run_dir = RunDir(tmp_path / "run").ensure()
    run_dir.write_run_info(started=time.time() - 5 if started is None else started)
    env = {"SDDOCTOR_RUN_DIR": str(run_dir.path), **recorder_environment(run_dir.path)}
    return run_dir, env


def _real_dump() -> bytes:
    """A dump written by torch itself (gloo records one too), in a process of its own."""
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "dist.all_reduce(torch.ones(3))\n"
        "sys.stdout.buffer.write(torch._C._distributed_c10d._dump_fr_trace())\n"
        "dist.destroy_process_group()\n"
    )
    from conftest import free_port

    out = subprocess.run(
        [sys.executable, "-c", code, str(free_port())],
        env=subprocess_env(TORCH_FR_BUFFER_SIZE="100"),
        capture_output=True,
        timeout=120,
    )
    if out.returncode != 0 or not out.stdout:
        pytest.skip(f"this torch writes no flight-recorder dump on gloo: {out.stderr[-300:]!r}")
    return out.stdout


def test_a_planted_payload_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    run_dir, env = _run(tmp_path)
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    Path(f"{prefix}0").write_bytes(pickle.dumps({"entries": [_Payload(marker)]}))
    Path(f"{prefix}1").write_bytes(pickle.dumps(_Payload(marker), protocol=0))  # GLOBAL + REDUCE
    result = flightrec.collect(env, [0, 1], wait=0.5)
    assert not marker.exists()
    assert result["ranks"] == {}
    assert set(result["rejected"]) == {"0", "1"}
    assert "posix.system" in result["rejected"]["0"] or "os.system" in result["rejected"]["0"]


def test_a_real_torch_dump_is_read(tmp_path):
    run_dir, env = _run(tmp_path)
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    Path(f"{prefix}0").write_bytes(_real_dump())
    result = flightrec.collect(env, [0], wait=0.5, asked_at=123.0)
    summary = result["ranks"]["0"]
    assert summary["total"] == 1
    (entry,) = summary["entries"]
    assert entry["seq"] == 1 and entry["op"].endswith("all_reduce") and entry["input_sizes"] == [[3]]
    assert result["asked_at"] == 123.0


def test_json_dumps_and_typed_lists_of_older_torch_are_read(tmp_path):
    run_dir, env = _run(tmp_path)
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    entry = {"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "state": "started"}
    Path(f"{prefix}0").write_text(json.dumps({"entries": [entry]}))
    # protocol 0 with GLOBAL torch.jit._pickle build_intlist, as TorchScript's pickler wrote lists
    typed = b"(dp0\nVentries\np1\n(lp2\n(dp3\nVinput_sizes\np4\nctorch.jit._pickle\nbuild_intlist\np5\n((lp6\nI4\naI2\natp7\nRp8\nsas."
    Path(f"{prefix}1").write_bytes(typed)
    result = flightrec.collect(env, [0, 1], wait=0.5)
    assert result["ranks"]["0"]["entries"][0]["seq"] == 7
    assert result["ranks"]["1"]["entries"][0]["input_sizes"] == [4, 2]


def test_only_this_run_this_user_and_fresh_regular_files_are_read(tmp_path):
    run_dir, env = _run(tmp_path, started=time.time())
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    plain = pickle.dumps({"entries": [{"collective_seq_id": 1}]})
    old = Path(f"{prefix}0")
    old.write_bytes(plain)
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # from an earlier run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(plain)
    Path(f"{prefix}1").symlink_to(elsewhere)  # a link pointing out of the run dir
    os.mkfifo(f"{prefix}2")  # a FIFO must not block the reader
    result = flightrec.collect(env, [0, 1, 2], wait=0.5)
    assert result is None or result["ranks"] == {}
    # a prefix outside the run directory is never read, even when a dump is there
    outside = dict(env, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "trace_"))
    (tmp_path / "trace_0").write_bytes(plain)
    result = flightrec.collect(outside, [0], wait=0.2, asked_at=1.0)
    assert result["ranks"] == {} and "outside the run directory" in result["problem"]


def test_safe_loads_refuses_anything_callable():
    for evil in (pickle.dumps(_Payload(Path("/nonexistent"))), pickle.dumps(print), pickle.dumps(Path("x"))):
        with pytest.raises(flightrec.UnsafeDump):
            flightrec.safe_loads(evil)
    assert flightrec.safe_loads(pickle.dumps({"a": (1, 2.5, None, True, b"x", {3})})) == {
        "a": (1, 2.5, None, True, b"x", {3})
    }
    with pytest.raises(ValueError):
        flightrec.safe_loads(pickle.dumps({"a": 1})[:-3])  # truncated


def test_the_backend_of_a_group_started_without_one_is_its_device_map(tmp_path):
    """`init_process_group()` with no backend: torch names the group's backend "undefined" and
    gives it one per device type; the rank reports that map, not "undefined"."""
    code = (
        "import os, sys, torch.distributed as dist\n"
        "from sddoctor.instrument.flight_recorder import default_backend\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1], RANK='0', WORLD_SIZE='1')\n"
        "print(default_backend())\n"
        "for form in (None, 'cpu:gloo', 'gloo'):\n"
        "    dist.init_process_group(form)\n"
        "    print(dist.get_backend(), default_backend(), dist.get_backend_config())\n"
        "    dist.destroy_process_group()\n"
    )
    from conftest import free_port

    out = subprocess.run([sys.executable, "-c", code, str(free_port())], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert lines[0] == ["None"]  # no process group yet
    (raw, reported, config), cpu_gloo, gloo = lines[1:]
    assert (raw, reported) == ("undefined", config) and "cpu:gloo" in config
    assert cpu_gloo[1] == "cpu:gloo" and gloo[1] == "gloo"


def test_an_nccl_group_started_without_a_backend_is_dumped(monkeypatch):
    """On a GPU build `init_process_group()` gives "cpu:gloo,cuda:nccl": its flight recorder is
    NCCL's and is dumped (before, the name "undefined" made the dump a no-op)."""
    import torch.distributed as dist

    from sddoctor.instrument import flight_recorder

    monkeypatch.setenv(flight_recorder.PIPE_FILE_ENV, "/nonexistent/pipe_")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    dumped: list[tuple[str, int]] = []
    monkeypatch.setattr(
        flight_recorder, "trigger_dump", lambda prefix, rank: dumped.append((prefix, rank)) or True
    )
    assert flight_recorder.dump_flight_recorder() is True
    assert dumped == [("/nonexistent/pipe_", 3)]
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    assert flight_recorder.dump_flight_recorder() is False and len(dumped) == 1
