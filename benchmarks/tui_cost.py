"""Cost benchmark of `sddoctor tui`, and of nvitop's data layer for comparison.

    python -m benchmarks.tui_cost [--seconds 10] [--fake-gpus 8] [--ranks 8] [--size 80x24 ...]
                                 [--json results.json]

Measures in one run:
  - per-sample cost of our collection (NVML + psutil), in a tight loop and at 1 Hz
  - CPU share of one core at 1 Hz over --seconds: our sampler alone, with the PCIe thread,
    and the headless app (sampling + rendering) at each --size, watching --ranks ranks
  - start-up time: a fresh `python` to the first frame with data, and `sddoctor tui --once`
  - the same figures for nvitop (`Device.all()` snapshots at 1 Hz, `nvitop -1`) when nvitop
    is importable and NVML works
Without a GPU, `--fake-gpus N` installs the fake NVML so our own overhead can still be measured
(NVML's own cost is then absent: on an H200 it is about 50 us per GPU per sample).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _cpu_share(work: Callable[[], Any], seconds: float, rate_hz: float = 1.0) -> dict[str, float]:
    """Run `work` at `rate_hz` for `seconds` in this process; CPU time used / wall time."""
    times = []
    period = 1.0 / rate_hz
    cpu0, wall0 = time.process_time(), time.perf_counter()
    next_t = wall0
    while time.perf_counter() - wall0 < seconds:
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
        next_t += period
        time.sleep(max(0.0, next_t - time.perf_counter()))
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    return {
        "cpu_percent_of_core": 100.0 * cpu / wall,
        "sample_ms_median": 1000 * statistics.median(times),
        "sample_ms_max": 1000 * max(times),
        "samples": len(times),
    }


def _tight(work: Callable[[], Any], n: int) -> dict[str, float]:
    work()  # warm
    cpu0 = time.process_time()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return {
        "sample_ms_median": 1000 * statistics.median(times),
        "sample_ms_p99": 1000 * sorted(times)[int(0.99 * (n - 1))],
        "cpu_ms_per_sample": 1000 * (time.process_time() - cpu0) / n,
    }


#: The order of `sddoctor tui` (sddoctor/tui/cli.py): NVML opens on a thread first, then the
#: app's imports, then the app; it renders headless here (run_test) instead of on a terminal.
STARTUP_SCRIPT = r"""
import asyncio, sys, time
t0 = float(sys.argv[1])
fake = int(sys.argv[2])
if fake:
    from sddoctor.testing.fake_nvml import FakeNvml, demo_gpus
    from sddoctor.gpu.nvml import set_nvml_for_tests
    import os
    set_nvml_for_tests(FakeNvml(demo_gpus(fake, [[(os.getpid(), 2 << 30)]] * fake)))
from sddoctor.gpu.source import NvmlSource
source = NvmlSource(open_in_background=True)
from sddoctor.gpu.collector import Collector
import gc
gc.disable()
try:
    from sddoctor.tui.app import MonitorApp
finally:
    gc.freeze()
    gc.enable()
async def main():
    app = MonitorApp(Collector(source), None, interval=1.0)
    async with app.run_test(size=(160, 50)) as pilot:
        while not app.ready:
            await pilot.pause(0.005)
        await pilot.pause()
        print(time.time() - t0, flush=True)
asyncio.run(main())
"""


def _startup(fake: int) -> float:
    """Seconds from launching a fresh interpreter to the app's first frame with GPU data."""
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-c", STARTUP_SCRIPT, repr(t0), str(fake)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def _wall(cmd: list[str]) -> float | None:
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return time.perf_counter() - t if out.returncode == 0 else None


#: A stand-in for a run of `ranks` ranks: rewrites each rank's state snapshot once a second
#: with the next step (as a rank does), in its own process so that its CPU is not counted.
RUN_WRITER = r"""
import json, os, sys, time
run, ranks = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.join(run, "ranks"), exist_ok=True)
step = 0
while True:
    now = time.time()
    for r in range(ranks):
        state = {"v": 1, "t": now, "rank": r, "pid": os.getpid(), "host": "bench", "local_rank": r,
                 "world_size": ranks, "device": r, "status": "running", "step": step, "heartbeat": now,
                 "phase": "backward",
                 "last_step": {"step": step, "loss": 0.1 + 0.01 * r, "step_time": 1.0, "samples": 16,
                               "micro_batch": 16, "grad_accum": 1, "mem_peak": 60 << 30, "t": now},
                 "collectives": {"inflight": [], "last_done": {"pg": "default", "seq": 3 * step,
                                 "op": "all_reduce", "caller": os.path.join(run, "train.py") + ":212",
                                 "t": now, "duration": 0.004}}}
        path = os.path.join(run, "ranks", f"rank-{r:05d}.state")
        with open(path + ".tmp", "w") as fh:
            json.dump(state, fh)
        os.replace(path + ".tmp", path)
    print("ready", flush=True)
    step += 1
    time.sleep(max(0.0, now + 1.0 - time.time()))
"""


def _headless_app_share(
    seconds: float, size: tuple[int, int] = (160, 50), ranks: int = 0
) -> dict[str, float]:
    import tempfile

    from sddoctor.gpu.collector import Collector
    from sddoctor.gpu.source import NvmlSource
    from sddoctor.ranks.feeds import RunDirFeed
    from sddoctor.tui.app import MonitorApp
    from sddoctor.tui.rowtable import RowTable

    result: dict[str, float] = {}
    tmp = tempfile.TemporaryDirectory(prefix="sddoctor-bench-")
    writer = None
    feed = None
    if ranks:
        run_dir = os.path.join(tmp.name, "run-bench")
        writer = subprocess.Popen(
            [sys.executable, "-c", RUN_WRITER, run_dir, str(ranks)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        feed = RunDirFeed(run_dir, pid_alive=None)

    async def main() -> None:
        app = MonitorApp(Collector(NvmlSource()), feed, interval=1.0)
        async with app.run_test(size=size) as pilot:
            while not app.ready:
                await pilot.pause(0.01)
            await pilot.pause(0.5)
            cpu0, wall0, n0 = time.process_time(), time.perf_counter(), app.gpu_updates
            await asyncio.sleep(seconds)
            wall = time.perf_counter() - wall0
            result["cpu_percent_of_core"] = 100.0 * (time.process_time() - cpu0) / wall
            result["frames"] = app.gpu_updates - n0
            result["rank_rows"] = app.query_one("#ranks", RowTable).row_count

    try:
        asyncio.run(main())
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
            writer.stdout.close()  # type: ignore[union-attr]
        tmp.cleanup()
    return result


def _nvitop_layer() -> Callable[[], Any] | None:
    try:
        from nvitop import Device, GpuProcess  # type: ignore[import-not-found]

        devices = Device.all()
    except Exception:  # noqa: BLE001 - not installed, or no NVML
        return None
    if not devices:
        return None

    def sample() -> Any:
        # what nvitop's monitor reads each refresh: a device snapshot and its processes' snapshots
        out = []
        for d in devices:
            snap = d.as_snapshot() if hasattr(d, "as_snapshot") else (d.gpu_utilization(), d.memory_used())
            procs = d.processes()
            out.append((snap, GpuProcess.take_snapshots(procs.values(), failsafe=True)))
        return out

    try:
        sample()
    except Exception as exc:  # noqa: BLE001 - another nvitop version: say so instead of failing the bench
        print(f"bench: nvitop's data layer could not be sampled ({exc!r}); leaving it out", file=sys.stderr)
        return None
    return sample


def run(
    seconds: float,
    fake_gpus: int,
    skip_app: bool,
    sizes: tuple[tuple[int, int], ...] = ((160, 50),),
    ranks: int = 0,
) -> dict[str, Any]:
    from sddoctor.gpu.collector import Collector
    from sddoctor.gpu.nvml import set_nvml_for_tests, unavailable_reason
    from sddoctor.gpu.source import NvmlSource

    results: dict[str, Any] = {"seconds": seconds}
    if fake_gpus:
        from sddoctor.testing.fake_nvml import FakeNvml, demo_gpus

        # one process per GPU (this one), so the psutil side of a sample is measured too
        set_nvml_for_tests(FakeNvml(demo_gpus(fake_gpus, [[(os.getpid(), 2 << 30)]] * fake_gpus)))
        results["nvml"] = f"fake ({fake_gpus} GPUs): our overhead only"
    else:
        reason = unavailable_reason()
        results["nvml"] = "real" if reason is None else f"unavailable: {reason}"

    src = NvmlSource(pcie_interval=5.0)
    results["gpus"] = src.device_count
    collector = Collector(src)
    results["ours_tight"] = _tight(collector.sample, 200)
    results["ours_gpu_only_tight"] = _tight(src.sample, 200)
    results["ours_1hz"] = _cpu_share(collector.sample, seconds)
    src.start_background()
    results["ours_1hz_with_pcie"] = _cpu_share(collector.sample, seconds)
    if src._pcie is not None:
        results["pcie_round_ms"] = 1000 * src._pcie.round_seconds
    collector.close()

    nvitop_sample = None if fake_gpus else _nvitop_layer()
    if nvitop_sample is not None:
        results["nvitop_tight"] = _tight(nvitop_sample, 50)
        results["nvitop_1hz"] = _cpu_share(nvitop_sample, seconds)
        exe = shutil.which("nvitop")
        results["nvitop_once_s"] = _wall([exe, "-1"] if exe else [sys.executable, "-m", "nvitop", "-1"])
    if not fake_gpus and shutil.which("gpustat"):
        results["gpustat_once_s"] = _wall(["gpustat"])

    results["ours_once_s"] = _wall([sys.executable, "-m", "sddoctor", "tui", "--once", "--no-run"])
    results["ours_startup_to_first_frame_s"] = min(_startup(fake_gpus) for _ in range(3))
    if not skip_app:
        results["ranks"] = ranks
        for w, h in sizes:
            results[f"ours_app_1hz_{w}x{h}"] = _headless_app_share(seconds, (w, h), ranks)
        results["ours_app_1hz"] = results[f"ours_app_1hz_{sizes[0][0]}x{sizes[0][1]}"]
    set_nvml_for_tests(None, None) if fake_gpus else None
    return results


def table(r: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    rows = [("figure", "sddoctor tui", "nvitop")]
    o1, n1 = r.get("ours_1hz", {}), r.get("nvitop_1hz", {})
    ot, nt = r.get("ours_tight", {}), r.get("nvitop_tight", {})
    rows += [
        (
            "per-sample wall, tight loop (ms, median)",
            f(ot.get("sample_ms_median"), "{:.3f}"),
            f(nt.get("sample_ms_median"), "{:.3f}"),
        ),
        (
            "per-sample CPU, tight loop (ms)",
            f(ot.get("cpu_ms_per_sample"), "{:.3f}"),
            f(nt.get("cpu_ms_per_sample"), "{:.3f}"),
        ),
        (
            "  of which GPU/NVML part (ms, median)",
            f(r.get("ours_gpu_only_tight", {}).get("sample_ms_median"), "{:.3f}"),
            "",
        ),
        (
            "per-sample wall at 1 Hz (ms, median)",
            f(o1.get("sample_ms_median"), "{:.3f}"),
            f(n1.get("sample_ms_median"), "{:.3f}"),
        ),
        (
            "CPU % of a core, data layer at 1 Hz",
            f(o1.get("cpu_percent_of_core"), "{:.3f}"),
            f(n1.get("cpu_percent_of_core"), "{:.3f}"),
        ),
        (
            "CPU % of a core, + PCIe thread (5 s)",
            f(r.get("ours_1hz_with_pcie", {}).get("cpu_percent_of_core"), "{:.3f}"),
            "",
        ),
        ("PCIe round, all GPUs (ms)", f(r.get("pcie_round_ms"), "{:.1f}"), ""),
        *[
            (
                f"CPU % of a core, headless app at 1 Hz, {key[len('ours_app_1hz_') :]}",
                f(value.get("cpu_percent_of_core"), "{:.2f}"),
                "",
            )
            for key, value in r.items()
            if key.startswith("ours_app_1hz_")
        ],
        ("start-up to first frame with data (s)", f(r.get("ours_startup_to_first_frame_s"), "{:.3f}"), ""),
        (
            "one-shot print (s): --once / nvitop -1",
            f(r.get("ours_once_s"), "{:.3f}"),
            f(r.get("nvitop_once_s"), "{:.3f}"),
        ),
    ]
    if r.get("gpustat_once_s") is not None:
        rows.append(("gpustat one-shot (s)", "", f(r["gpustat_once_s"], "{:.3f}")))
    w0 = max(len(x[0]) for x in rows)
    lines = [
        f"NVML: {r.get('nvml')}; GPUs: {r.get('gpus')}; ranks: {r.get('ranks', 0)}; "
        f"1 Hz phases of {r.get('seconds')} s each"
    ]
    for i, (a, b, c) in enumerate(rows):
        lines.append(f"| {a:<{w0}} | {b:>12} | {c:>10} |")
        if i == 0:
            lines.append(f"|{'-' * (w0 + 2)}|{'-' * 14}|{'-' * 12}|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tui_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=10.0, help="length of each 1 Hz phase (default 10)")
    p.add_argument("--fake-gpus", type=int, default=0, metavar="N", help="use the fake NVML with N GPUs")
    p.add_argument("--skip-app", action="store_true", help="leave out the headless app phase")
    p.add_argument(
        "--size",
        action="append",
        metavar="WxH",
        help="terminal size of the headless app phase; repeat for several (default 160x50)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=0,
        metavar="N",
        help="the app also watches a run of N ranks whose snapshots advance once a second",
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    sizes = []
    for text in args.size or ["160x50"]:
        w, sep, h = text.partition("x")
        if not (sep and w.isdigit() and h.isdigit() and int(w) >= 20 and int(h) >= 10):
            print(f"bench: --size {text!r}: expected WIDTHxHEIGHT, e.g. --size 80x24", file=sys.stderr)
            return 2
        sizes.append((int(w), int(h)))
    if args.seconds <= 0 or args.fake_gpus < 0 or args.ranks < 0:
        print("bench: --seconds must be > 0, --fake-gpus and --ranks >= 0", file=sys.stderr)
        return 2
    results = run(args.seconds, args.fake_gpus, args.skip_app, tuple(sizes), args.ranks)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
