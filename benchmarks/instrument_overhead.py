"""Overhead of the rank-side instrumentation, measured with and without it in one run.

    python -m benchmarks.instrument_overhead                 # 2-rank gloo DDP on CPU (+ 1-GPU NCCL if CUDA)
    python -m benchmarks.instrument_overhead --micro         # cost of one traced call, in microseconds
    python -m benchmarks.instrument_overhead --timeline      # the collective timeline alone, on vs off
    python -m benchmarks.instrument_overhead --unchanged     # an unchanged DDP program: comm hook + steps inferred
    python -m benchmarks.instrument_overhead --json          # machine-readable

The training benchmark alternates blocks of steps (on, off, off, on, ...) with the instrumentation on (a rank
session: telemetry writer, heartbeat, collective tracing, exit hooks) and off (no session,
torch.distributed unpatched), so that drift in the machine's load hits both alike, and reports
the median step time of each and their ratio. Each step is a DDP forward/backward/optimizer step
plus what a training script usually adds: one all-reduce of the loss for logging and
`sdi.step(...)`. Exit code 0; 1 if a measurement failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _session_on(run_dir: Path, rank: int, world: int) -> None:
    from sddoctor.instrument import api

    api.enable(run_dir, rank=rank, local_rank=rank, world_size=world, trace=True)
    session = api.active()
    if session is not None:
        session.install_tracing()


def _session_off() -> None:
    from sddoctor.instrument import api

    api.disable()


def _set_timeline(on: bool) -> None:
    """Turn the collective timeline (the tracer's buffer and its file) on or off in this rank's session."""
    import collections

    from sddoctor.instrument import api, tracing

    session = api.active()
    if session is not None and session.tracer is not None:
        session.tracer.recent = collections.deque(maxlen=tracing.RECENT_MAX) if on else None


def _train_blocks(
    rank: int,
    world: int,
    model: Any,
    batch: Any,
    blocks: int,
    steps: int,
    run_dir: Path,
    device: str,
    what: str = "session",
) -> dict[str, list[float]]:
    """Alternating blocks of steps with `what` on and off: "session" (all of the instrumentation)
    or "timeline" (the collective timeline, with the rest of the instrumentation on throughout)."""
    import torch
    import torch.distributed as dist

    from sddoctor.instrument import api as sdi

    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = batch
    times: dict[str, list[float]] = {"on": [], "off": [], "cpu_on": [], "cpu_off": [], "pairs": []}

    def one_step(step: int) -> tuple[float, float]:
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if device == "cuda":
            torch.cuda.synchronize()
        sdi.step(step, loss=float(logged), samples=x.shape[0] * world)
        return time.perf_counter() - t0, time.process_time() - c0

    if what == "timeline":
        _session_on(run_dir, rank, world)
    for _ in range(3):  # warm-up: DDP rebuilds its buckets after the first iteration
        one_step(0)
    step = 0
    for block in range(blocks):
        # on, off, off, on, ...: each mode comes first in half of the pairs, so an order effect cancels
        mode = "on" if block % 4 in (0, 3) else "off"
        if what == "timeline":
            _set_timeline(mode == "on")
        elif mode == "on":
            _session_on(run_dir, rank, world)
        dist.barrier()
        for _ in range(steps):
            wall, cpu = one_step(step)
            times[mode].append(wall)
            times["cpu_" + mode].append(cpu)
            step += 1
        if mode == "on" and what == "session":
            _session_off()
        if block % 2 == 1:  # a pair of neighbouring blocks, one of each: drift of the load cancels
            times["pairs"].append(
                statistics.median(times["on"][-steps:]) / statistics.median(times["off"][-steps:])
            )
    if what == "timeline":
        _session_off()
    return times


def _join_gloo(rank: int, world: int, port: int) -> None:
    """This process joins the 2-rank gloo group of a CPU benchmark, one thread per rank."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _join_nccl() -> None:
    """This process is the one rank of an NCCL group on GPU 0."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)


def _cpu_mlp() -> Any:
    """The CPU benchmarks' model (seeded: every rank and copy starts alike)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 64),
    )  # fmt: skip


#: the GPU benchmarks' MLP: 8 square layers of this width (134M parameters)
_GPU_WIDTH = 4096


def _gpu_mlp() -> Any:
    """The GPU benchmarks' model (seeded)."""
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(_GPU_WIDTH, _GPU_WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


def _gpu_batch() -> tuple[Any, Any]:
    import torch

    return (
        torch.randn(256, _GPU_WIDTH, device="cuda"),
        torch.randn(256, _GPU_WIDTH, device="cuda"),
    )


def _gloo_rank(
    rank: int, world: int, port: int, blocks: int, steps: int, run_dir: str, out: Any, what: str = "session"
) -> None:
    import torch
    import torch.distributed as dist

    _join_gloo(rank, world, port)
    model = _cpu_mlp()
    batch = (torch.randn(32, 256), torch.randn(32, 64))
    times = _train_blocks(rank, world, model, batch, blocks, steps, Path(run_dir), "cpu", what)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def bench_gloo(blocks: int, steps: int, what: str = "session") -> dict[str, Any]:
    return _result("gloo, 2 ranks, CPU MLP DDP" + _what(what), _run_gloo(_gloo_rank, blocks, steps, what))


def _run_gloo(target: Any, blocks: int, steps: int, *extra: Any) -> dict[str, list[float]]:
    """Run `target(rank, world, port, blocks, steps, run_dir, queue, *extra)` on 2 gloo ranks; rank 0's times."""
    import multiprocessing as mp

    from sddoctor.instrument.tracing import uninstall  # noqa: F401  (import check before spawning)

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="sddoctor-bench-") as run_dir:
        procs = [
            ctx.Process(target=target, args=(r, 2, port, blocks, steps, run_dir, queue, *extra))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            times = queue.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
                    p.join()
    return times


def _what(what: str) -> str:
    return "; collective timeline on vs off (instrumentation on throughout)" if what == "timeline" else ""


def _unchanged_rank(
    rank: int, world: int, port: int, blocks: int, steps: int, run_dir: str, out: Any, what: str = "hook"
) -> None:
    """A gloo rank of `_unchanged_blocks` on a CPU MLP."""
    import torch
    import torch.distributed as dist

    _join_gloo(rank, world, port)
    batch = (torch.randn(32, 256), torch.randn(32, 64))
    times = _unchanged_blocks(rank, world, _cpu_mlp, batch, blocks, steps, Path(run_dir), what, "cpu")
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _unchanged_blocks(
    rank: int, world: int, make_model: Any, batch: Any, blocks: int, steps: int, run_dir: Path, what: str,
    device: str,
) -> dict[str, list[float]]:  # fmt: skip
    """An unchanged DDP program under a rank session (tracing, heartbeat on throughout), two copies
    of one model trained in alternating blocks. what="hook": "off" is built before the session (DDP's
    own C++ comm hook), "on" with it (sddoctor's comm hook, whose bucket all-reduces are traced, and
    step inference). what="inference": both carry sddoctor's comm hook, "on" also infers steps."""
    import torch
    import torch.distributed as dist

    from sddoctor.instrument import api

    ids = [0] if device == "cuda" else None
    if what == "hook":
        plain = torch.nn.parallel.DistributedDataParallel(make_model(), device_ids=ids)
        _session_on(run_dir, rank, world)
    else:
        _session_on(run_dir, rank, world)
        session = api.active()
        assert session is not None
        session.infer_steps = False  # hooked (at its first forward), but no steps inferred from it
        plain = torch.nn.parallel.DistributedDataParallel(make_model(), device_ids=ids)
        session.infer_steps = True
    inferred = torch.nn.parallel.DistributedDataParallel(make_model(), device_ids=ids)
    x, y = batch
    models = {"off": plain, "on": inferred}
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {"on": [], "off": [], "cpu_on": [], "cpu_off": [], "pairs": []}

    def one_step(mode: str) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        optims[mode].zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(models[mode](x), y)
        loss.backward()
        optims[mode].step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # what a script logs
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    for mode in ("on", "off", "on", "off", "on", "off"):  # warm-up: DDP rebuilds its buckets
        one_step(mode)
    for block in range(blocks):
        mode = "on" if block % 4 in (0, 3) else "off"
        dist.barrier()
        for _ in range(steps):
            wall, cpu = one_step(mode)
            times[mode].append(wall)
            times["cpu_" + mode].append(cpu)
        if block % 2 == 1:
            times["pairs"].append(
                statistics.median(times["on"][-steps:]) / statistics.median(times["off"][-steps:])
            )
    session = api.active()
    inferred_steps = session.inference.step if session is not None and session.inference is not None else 0
    times["inferred"] = [float(inferred_steps)]
    _session_off()
    models.clear()  # free the DDP models before the process group (gloo teardown)
    optims.clear()
    del plain, inferred
    return times


def bench_gloo_unchanged(blocks: int, steps: int) -> list[dict[str, Any]]:
    """Two results: sddoctor's comm hook and step inference against DDP's own hook, then step
    inference alone (both models hooked)."""
    out = []
    for what, name in (
        ("hook", "gloo, 2 ranks, CPU MLP DDP, unchanged program: sddoctor's comm hook + inferred steps vs DDP's own hook"),
        ("inference", "gloo, 2 ranks, CPU MLP DDP, unchanged program: step inference on vs off (both hooked)"),
    ):  # fmt: skip
        times = _run_gloo(_unchanged_rank, blocks, steps, what)
        result = _result(name, times)
        result["inferred_steps"] = int(times["inferred"][0])
        out.append(result)
    return out


def bench_nccl_unchanged(blocks: int, steps: int) -> list[dict[str, Any]]:
    """`bench_gloo_unchanged` on one GPU with NCCL: a 134M-parameter MLP (DDP makes a few dozen
    buckets of it), sddoctor's comm hook and step inference on vs off."""
    import torch
    import torch.distributed as dist

    _join_nccl()
    batch = _gpu_batch()
    out = []
    for what in ("hook", "inference"):
        with tempfile.TemporaryDirectory(prefix="sddoctor-bench-") as run_dir:
            times = _unchanged_blocks(0, 1, _gpu_mlp, batch, blocks, steps, Path(run_dir), what, "cuda")
        label = (
            "sddoctor's comm hook + inferred steps vs DDP's own hook"
            if what == "hook"
            else "step inference on vs off"
        )
        result = _result(
            f"nccl, 1 GPU ({torch.cuda.get_device_name(0)}), MLP 134M DDP, unchanged program: {label}", times
        )
        result["inferred_steps"] = int(times["inferred"][0])
        out.append(result)
    dist.destroy_process_group()
    return out


def bench_nccl(blocks: int, steps: int, what: str = "session") -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _join_nccl()
    model = _gpu_mlp()
    batch = _gpu_batch()
    with tempfile.TemporaryDirectory(prefix="sddoctor-bench-") as run_dir:
        times = _train_blocks(0, 1, model, batch, blocks, steps, Path(run_dir), "cuda", what)
    dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())
    return _result(
        f"nccl, 1 GPU ({torch.cuda.get_device_name(0)}), MLP {params / 1e6:.0f}M params DDP" + _what(what),
        times,
    )


def microbench_inference(steps: int = 20000, rounds: int = 5) -> dict[str, Any]:
    """What step inference adds to one step of an unchanged DDP program: its forward pre-hook and the
    end of the step at the last gradient bucket (a `step` event), timed on this thread's CPU."""
    import torch
    import torch.distributed as dist

    from sddoctor.instrument import api

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="sddoctor-bench-") as run_dir:
        _session_on(Path(run_dir), 0, 1)
        session = api.active()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        x = torch.randn(4, 8)
        model(x).sum().backward()  # installs the hook, attaches the inference
        inference = session.inference if session is not None else None
        if inference is None or inference._primary is None:
            raise RuntimeError("step inference did not attach to the DDP model")
        ref = inference._primary
        per_step = []
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(steps):
                inference._on_forward(ref, (x,), {})
                inference._on_synced_backward(ref)
            per_step.append((time.thread_time() - t0) / steps * 1e6)
        _session_off()
        del model
    dist.destroy_process_group()
    return {
        "name": "step inference per step (forward pre-hook + step event)",
        "inference_us": round(statistics.median(per_step), 2),
    }


def microbench(calls: int = 20000, rounds: int = 7) -> dict[str, Any]:
    """Per-call cost of the tracing hot path.

    Measured on a no-op function wrapped exactly like all_reduce (so gloo's own ~100 us and its
    noise do not drown a few microseconds), plus a real gloo all_reduce for scale. CPU time of
    this thread (time.thread_time), so that time spent descheduled on a busy machine is not counted.
    """
    import torch
    import torch.distributed as dist

    from sddoctor.instrument import tracing

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    t = torch.ones(8, 8)

    def noop(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    spec = next(s for s in tracing._SPECS if s.name == "all_reduce")
    per_call: dict[str, list[float]] = {"off": [], "on": [], "no_timeline": [], "gloo_off": [], "gloo_on": []}
    per_call["flush"] = []
    tracer = None
    for _ in range(rounds):
        for mode in ("off", "on", "no_timeline"):
            if mode != "off":
                tracer = tracing.install(0)
                if mode == "no_timeline":
                    tracer.recent = None
            fn = tracing._make_wrapper(noop, spec) if mode != "off" else noop
            t0 = time.thread_time()
            for _ in range(calls):
                fn(t)
            per_call[mode].append((time.thread_time() - t0) / calls * 1e6)
            if mode == "no_timeline":
                tracing.uninstall()
                continue
            if mode == "on":
                per_call["flush"].append(_timeline_flush_us(tracer, fn, t))
            real = dist.all_reduce
            t0 = time.thread_time()
            for _ in range(calls // 20):
                real(t)
            per_call["gloo_" + mode].append((time.thread_time() - t0) / (calls // 20) * 1e6)
            if mode == "on":
                tracing.uninstall()
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in per_call.items()}
    return {
        "name": "tracing hot path per call (all_reduce of an 8x8 tensor, caller lookup cached)",
        "untraced_us": round(med["off"], 3),
        "traced_us": round(med["on"], 3),
        "overhead_us": round(med["on"] - med["off"], 3),
        "gloo_all_reduce_untraced_us": round(med["gloo_off"], 1),
        "gloo_all_reduce_traced_us": round(med["gloo_on"], 1),
        "timeline_us": round(med["on"] - med["no_timeline"], 3),
        "timeline_flush_us": round(med["flush"], 3),
        "calls": calls,
        "recorded": tracer.snapshot()["issued"] if tracer is not None else None,
    }


def _timeline_flush_us(tracer: Any, fn: Any, tensor: Any) -> float:
    """Heartbeat-thread CPU time to write one buffered call to the timeline file (a full buffer)."""
    from types import SimpleNamespace

    from sddoctor.instrument.timeline import TimelineRecorder
    from sddoctor.instrument.tracing import RECENT_MAX
    from sddoctor.telemetry import RunDir

    recorder = TimelineRecorder(tracer)
    for _ in range(RECENT_MAX):
        fn(tensor)
    with tempfile.TemporaryDirectory(prefix="sddoctor-bench-") as run_dir:
        writer = SimpleNamespace(run_dir=RunDir(run_dir).ensure(), rank=0)
        t0 = time.thread_time()
        written = recorder.flush(writer)
        return (time.thread_time() - t0) / max(1, written) * 1e6


def _result(name: str, times: dict[str, list[float]]) -> dict[str, Any]:
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    # CPU seconds of the whole process (all threads, ours included) per step: on a busy shared
    # machine this is far less noisy than wall time, and the instrumentation's cost is CPU.
    cpu_on, cpu_off = sum(times["cpu_on"]), sum(times["cpu_off"])
    return {
        "paired_ratio_on_off": round(statistics.median(times["pairs"]), 4) if times["pairs"] else None,
        "cpu_ratio_on_off": round(cpu_on / cpu_off, 4) if cpu_off else None,
        "name": name,
        "steps_on": len(times["on"]),
        "steps_off": len(times["off"]),
        "median_step_on_ms": round(on * 1e3, 3),
        "median_step_off_ms": round(off * 1e3, 3),
        "ratio_on_off": round(on / off, 4),
        "overhead_pct": round((on / off - 1) * 100, 2),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.instrument_overhead",
        description="Step time with and without sddoctor's rank instrumentation, interleaved in one run.",
        epilog="examples:\n  python -m benchmarks.instrument_overhead\n  python -m benchmarks.instrument_overhead --micro --json\n"
        "exit codes: 0 measured, 1 a measurement failed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--micro", action="store_true", help="only the per-call cost of the tracing wrapper")
    parser.add_argument("--calls", type=int, default=20000, help="calls per round of --micro (default 20000)")
    parser.add_argument("--blocks", type=int, default=10, help="alternating on/off blocks (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    parser.add_argument(
        "--no-cuda", action="store_true", help="skip the NCCL benchmark even if CUDA is there"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="toggle only the collective timeline between blocks (the rest of the instrumentation stays on)",
    )
    parser.add_argument(
        "--unchanged",
        action="store_true",
        help="only an unchanged DDP program: sddoctor's comm hook and step inference on vs off",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    try:
        if args.micro:
            results.append(microbench(calls=args.calls))
            results.append(microbench_inference())
        elif args.unchanged:
            results += bench_gloo_unchanged(args.blocks, args.steps)
            if not args.no_cuda:
                import torch

                if torch.cuda.is_available():
                    results += bench_nccl_unchanged(args.blocks, args.steps)
        else:
            what = "timeline" if args.timeline else "session"
            results.append(bench_gloo(args.blocks, args.steps, what))
            if not args.no_cuda:
                import torch

                if torch.cuda.is_available():
                    results.append(bench_nccl(args.blocks, args.steps, what))
    except Exception as exc:  # noqa: BLE001 - report, do not dump a traceback
        print(f"benchmark failed: {exc!r}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"results": results}))
    else:
        for r in results:
            if "ratio_on_off" in r:
                print(
                    f"{r['name']}: step {r['median_step_off_ms']} ms off, {r['median_step_on_ms']} ms on "
                    f"-> ratio {r['ratio_on_off']} ({r['overhead_pct']:+.2f}%); median of paired block ratios "
                    f"{r['paired_ratio_on_off']}; process CPU time ratio "
                    f"{r['cpu_ratio_on_off']}; {r['steps_on']}+{r['steps_off']} steps"
                    + (f"; {r['inferred_steps']} steps inferred" if "inferred_steps" in r else "")
                )
            elif "inference_us" in r:
                print(f"{r['name']}: {r['inference_us']} us")
            else:
                print(
                    f"{r['name']}: {r['untraced_us']} us untraced, {r['traced_us']} us traced "
                    f"-> {r['overhead_us']} us per call, of which the timeline buffer {r['timeline_us']} us "
                    f"and {r['timeline_flush_us']} us to write it later (heartbeat thread) "
                    f"(a real gloo all_reduce here: "
                    f"{r['gloo_all_reduce_untraced_us']} us untraced, {r['gloo_all_reduce_traced_us']} us traced)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
