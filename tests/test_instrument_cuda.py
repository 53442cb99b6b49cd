"""Tracing on NCCL: completion through CUDA events and Work objects, the flight recorder dump.

Run on a CUDA machine (scripts/gpu/instrument.sh); skipped elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from instrument_fixtures import collectives, events, reap, wait_for

from conftest import REPO_ROOT, free_port, subprocess_env

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NCCL_ONE_RANK = """
import os, sys, time, torch, torch.distributed as dist
from sddoctor.instrument import api, tracing
from sddoctor.instrument.flight_recorder import dump_flight_recorder
api.enable(sys.argv[1], rank=0, world_size=1)
dist.init_process_group("nccl", init_method=sys.argv[2], rank=0, world_size=1)
torch.cuda.set_device(0)
x = torch.ones(64 * 1024 * 1024, device="cuda")
dist.all_reduce(x)                                   # returns before the GPU is done
rec = tracing.active().snapshot()
print("DEFERRED", any(c["async"] for c in rec["inflight"]) or rec["last_done"]["async"], flush=True)
w = dist.all_reduce(x, async_op=True)
w.wait()
torch.cuda.synchronize()
time.sleep(2.5)                                      # the heartbeat polls
snap = tracing.active().snapshot()
print("DONE", snap["inflight"] == [], snap["last_done"]["seq"], flush=True)
print("DUMPED", dump_flight_recorder(), flush=True)
time.sleep(3)
dist.destroy_process_group()
"""


@pytest.mark.xfail(
    strict=False,
    reason="seen on an H200 with torch 2.11: the dump is written and every check before it passes, "
    "then the rank dies of SIGSEGV inside ProcessGroupNCCL a few seconds after the dump; also with "
    "TORCH_INCLUDE_STACK_TRACE=0, and not without sddoctor's tracing and heartbeat",
)
def test_nccl_collectives_complete_through_polling_and_flight_recorder_dumps(tmp_path: Path) -> None:
    from sddoctor.instrument.boot import rank_environment

    env = subprocess_env()
    env.update(rank_environment(tmp_path, env))
    out = subprocess.run(
        [sys.executable, "-c", NCCL_ONE_RANK, str(tmp_path), f"tcp://127.0.0.1:{free_port()}"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["DEFERRED"] == "True"
    assert lines["DONE"] == "True 2"
    assert lines["DUMPED"] == "True", "the NCCL flight recorder pipe was not there"
    dumps = list((tmp_path / "stacks").glob("nccl_trace_rank_0*"))
    assert dumps, sorted(p.name for p in (tmp_path / "stacks").iterdir())
    assert events(tmp_path, 0, "collective")[-1]["ops"]["all_reduce"]["count"] == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_skip_shows_the_waiting_rank_inside_the_collective(tmp_path: Path) -> None:
    """On NCCL the waiting rank's all_reduce returns at once; the tracer still shows it in flight."""
    from instrument_fixtures import rank_env

    code = (
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "r = dist.get_rank(); torch.cuda.set_device(r)\n"
        "x = torch.ones(1024, device='cuda')\n"
        "for i in range(5):\n"
        "    dist.all_reduce(x)  # line 6\n"
        "    torch.cuda.synchronize()\n"
    )
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=rank_env(tmp_path, r, 2, port, SDDOCTOR_FAULT="skip:rank=1,seq=3"),
                         cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in range(2)
    ]  # fmt: skip
    try:
        inflight = wait_for(lambda: collectives(tmp_path, 0).get("inflight"), 60, "rank 0 in #3")
        issued1 = wait_for(lambda: collectives(tmp_path, 1).get("issued"), 30, "rank 1's state")
    finally:
        reap(procs)
    assert inflight[0]["seq"] == 3 and inflight[0]["async"] is True and inflight[0]["caller"] == "<string>:6"
    assert issued1 == {"0": 2}
