"""Fixtures of the TUI tests: a deterministic demo (fake NVML, fixed host, a run directory
with fixed timestamps, a frozen clock) and a real run directory written by a 2-rank gloo job."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import free_port, subprocess_env
from sddoctor.gpu.collector import Collector
from sddoctor.gpu.host import FixedHost, ProcessInfo
from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.gpu.source import NvmlSource
from sddoctor.ranks.feeds import RunDirFeed
from sddoctor.testing.fake_nvml import FakeNvml, demo_gpus

NOW = 1_800_000_000.0  # the frozen "now" of the demo
DEMO_PIDS = tuple(41001 + i for i in range(8))
#: where a library call site of the demo lives: shown from the package on (torch/...)
LIBRARY_SITE = "/opt/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:1523"


def frozen_clock() -> float:
    return NOW


def isolate_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry of live runs of the test's own, empty: `sddoctor run`s elsewhere on this machine
    stay out of view. Returns the directory of its entries (not created yet)."""
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime / "sddoctor" / "runs"


def write_demo_run(path: Path, world: int = 4, job_dir: Path | None = None) -> Path:
    """A `world`-rank run (4 or 8): rank 0/1 training, rank 2 stuck in all_reduce #812 (hang
    verdict), rank 3 recovered from an OOM with a smaller micro-batch; ranks 4-7 training, rank 5's
    last collective called from inside torch. Fixed timestamps. With `job_dir`, the call sites
    are absolute paths in it (as a rank reports them) and the stack dump names them so too."""
    ranks = path / "ranks"
    ranks.mkdir(parents=True)
    (path / "stacks").mkdir()
    (path / "run.json").write_text(
        json.dumps({"v": 1, "created": NOW - 600, "host": "node0", "world_size": world})
    )
    script = f"{job_dir}/train.py" if job_dir is not None else "train.py"
    for r, pid in enumerate(DEMO_PIDS[:world]):
        events = [
            {
                "v": 1,
                "t": NOW - 600,
                "rank": r,
                "kind": "start",
                "pid": pid,
                "host": "node0",
                "local_rank": r,
                "world_size": world,
                "device": f"cuda:{r}",
                "backend": "nccl",
            }
        ]
        for k in range(10):
            step = 800 + k
            events.append(
                {
                    "v": 1,
                    "t": NOW - 20 + 2 * k,
                    "rank": r,
                    "kind": "step",
                    "step": step,
                    "loss": 0.1 + 0.01 * r,
                    "samples": 16,
                    "step_time": 2.0,
                }
            )
        state = {
            "v": 1,
            "t": NOW - 1,
            "rank": r,
            "pid": pid,
            "host": "node0",
            "local_rank": r,
            "world_size": world,
            "device": f"cuda:{r}",
            "status": "running",
            "step": 809,
            "heartbeat": NOW - 1,
            "phase": "backward",
            "last_step": {
                "step": 809,
                "loss": 0.1 + 0.01 * r,
                "step_time": 2.0,
                "samples": 16,
                "micro_batch": 16,
                "grad_accum": 1,
                "mem_peak": 60 << 30,
                "t": NOW - 2,
            },
            "collectives": {
                "inflight": [],
                "issued": {"default": 811},
                "last_done": {
                    "pg": "default",
                    "seq": 811,
                    "op": "all_reduce",
                    "shapes": [[1024]],
                    "caller": LIBRARY_SITE if r == 5 else f"{script}:212",
                    "t": NOW - 2,
                    "duration": 0.0042,
                },
            },
        }
        if r == 2:
            state["collectives"]["inflight"] = [
                {
                    "pg": "default",
                    "seq": 812,
                    "op": "all_reduce",
                    "shapes": [[1024]],
                    "dtypes": ["float32"],
                    "caller": f"{script}:212",
                    "since": NOW - 95,
                    "async": False,
                }
            ]
        if r == 3:
            fb = {
                "v": 1,
                "t": NOW - 10,
                "rank": 3,
                "kind": "fallback",
                "step": 805,
                "old_micro_batch": 16,
                "new_micro_batch": 8,
                "old_grad_accum": 1,
                "new_grad_accum": 2,
                "reason": "oom",
            }
            events.append(fb)
            state["last_step"].update(micro_batch=8, grad_accum=2)
        (ranks / f"rank-{r:05d}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (ranks / f"rank-{r:05d}.state").write_text(json.dumps(state))
    report = {
        "verdicts": [
            {
                "kind": "hang.missing_rank",
                "severity": "error",
                "culprit_rank": 1,
                "location": f"{script}:188",
                "summary": f"rank 1 never reached all_reduce #812; it is in save_checkpoint ({script}:188)",
                "details": {},
                "evidence": [],
            }
        ]
    }
    (path / "report.json").write_text(json.dumps(report))
    (path / "stacks" / "rank-00001.txt").write_text(
        f'Thread 41002 (idle): "MainThread"\n    save_checkpoint ({script}:188)\n    main ({script}:240)\n'
    )
    return path


def demo_processes() -> dict[int, ProcessInfo]:
    return {
        pid: ProcessInfo(
            user="alice",
            cpu_percent=98.0 + i,
            rss=(6 + i) << 30,
            command=f"python train.py --config sd2.yaml  # local rank {i}",
        )
        for i, pid in enumerate(DEMO_PIDS)
    }


def install_demo_nvml(n_gpus: int = 4) -> FakeNvml:
    """4 or 8 GPUs; each rank on its own GPU, rank 3 also holds memory on GPU 0 (the wrong-GPU
    case), and one process no rank claims."""
    procs = [
        [(DEMO_PIDS[0], 52 << 30), (DEMO_PIDS[3], 600 << 20)],
        [(DEMO_PIDS[1], 51 << 30)],
        [(DEMO_PIDS[2], 53 << 30), (55555, 1 << 30)],
        [(DEMO_PIDS[3], 40 << 30)],
    ] + [[(DEMO_PIDS[i], (44 + i) << 30)] for i in range(4, 8)]
    fake = FakeNvml(demo_gpus(n_gpus, procs[:n_gpus]))
    set_nvml_for_tests(fake)
    return fake


def demo_collector(nvml: bool = True, warm: int = 30, n_gpus: int = 4) -> Collector:
    if nvml:
        install_demo_nvml(n_gpus)
    else:
        set_nvml_for_tests(
            None, "NVML could not start (NVML Shared Library Not Found): no NVIDIA driver or GPU"
        )
    collector = Collector(
        NvmlSource(pcie_interval=0), FixedHost(processes=demo_processes()), clock=frozen_clock
    )
    for _ in range(warm):  # history for the sparklines, deterministic
        collector.sample()
    return collector


def demo_feed(run_dir: Path) -> RunDirFeed:
    return RunDirFeed(run_dir, clock=frozen_clock, hostname="node0", pid_alive=None)


# -- a real 2-rank gloo run -----------------------------------------------------------------------

RANK_SCRIPT = r"""
import sys, time
import torch, torch.distributed as dist
from sddoctor.instrument import api as sdi

run_dir, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
sdi.enable(run_dir, backend="gloo")
x = torch.ones(1024)
for step in range(steps):
    t0 = time.time()
    dist.all_reduce(x)
    time.sleep(0.02)
    sdi.step(step, loss=1.0 / (step + 1), samples=4, step_time=time.time() - t0, micro_batch=4, grad_accum=1)
sdi.active().writer.flush()
print("ready", flush=True)
sys.stdin.read()  # hold the process (and its pid) until the test closes stdin
sdi.disable()
dist.destroy_process_group()
"""


class GlooRun:
    """Two real rank processes that wrote telemetry and stay alive until `stop()`."""

    def __init__(self, run_dir: Path, steps: int = 5) -> None:
        self.run_dir = run_dir
        port = free_port()
        self.procs: list[subprocess.Popen[str]] = []
        for rank in range(2):
            env = subprocess_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RANK_SCRIPT, str(run_dir), str(steps)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        deadline = time.time() + 90
        for p in self.procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready" or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"gloo rank did not start: {line!r} {p.stderr.read() if p.stderr else ''}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


@contextlib.contextmanager
def serve_state(payload: dict) -> Iterator[str]:
    """A local http.server answering GET /api/state with a recorded payload; yields HOST:PORT."""
    body = json.dumps(payload).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path != "/api/state":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
