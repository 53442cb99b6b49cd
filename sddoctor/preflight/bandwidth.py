"""The real collective test: one process per GPU (gloo on CPU: 2 processes), a size sweep of
all-reduce, all-gather and broadcast, checked for correctness and timed like nccl-tests.

Definitions (as nccl-tests has them, float32 data, `size` in bytes):
  all_reduce  size = the buffer on each rank;      algbw = size / time;  busbw = algbw * 2(n-1)/n
  all_gather  size = the gathered output buffer;   algbw = size / time;  busbw = algbw * (n-1)/n
  broadcast   size = the buffer;                   algbw = size / time;  busbw = algbw
`time` is one operation's time averaged over the timed iterations and then over the ranks (nccl-tests'
default `-a 1`), measured with CUDA events on GPU and the wall clock on gloo. GB/s means 1e9 bytes/s.

The parent never waits forever: a rank that has not finished by `timeout` is killed, and the result
says which ranks never joined the process group and which joined but hung (and in which collective).
The worker runs as `python -m sddoctor.preflight.bandwidth --worker CONFIG`; torch is imported only
in the worker (or by `run_inline` under torchrun), never at module import. Local rank 0 of each node
also reads torch's versions and devices for the parent's checks (`BandwidthResult.torch`), first
thing after importing torch, so that a rank stuck later in the test still delivers them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ELEMENT_BYTES = 4  # float32
#: SDDOCTOR_PREFLIGHT_FAULT=hang:RANK (sleep forever before joining) or exit:RANK (exit 3 before joining).
FAULT_ENV = "SDDOCTOR_PREFLIGHT_FAULT"
#: busbw at or above this many bytes is compared with what the links should give.
JUDGE_MIN_BYTES = 32 * 1024 * 1024
LOW_FRACTION = 0.5
#: BandwidthResult.error when the caller's `stop` ended the test.
STOPPED = "stopped before the test finished"

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


class SizeSpecError(ValueError):
    """A --sizes value could not be parsed; the message says what was wrong."""


def parse_sizes(text: str) -> list[int]:
    """'1M,64M,1G' -> bytes (K/M/G are powers of 1024, as in nccl-tests' -b/-e)."""
    sizes = []
    for part in text.split(","):
        token = part.strip().upper().removesuffix("IB").removesuffix("B") if part.strip() else ""
        if not token:
            raise SizeSpecError(f"empty size in {text!r}; write sizes like 1M,64M,1G")
        unit = token[-1] if token[-1] in "KMG" else ""
        number = token[:-1] if unit else token
        try:
            value = float(number) * _UNITS[unit]
        except ValueError:
            raise SizeSpecError(f"{part.strip()!r} is not a size; write sizes like 1M,64M,1G") from None
        if value < ELEMENT_BYTES or value > 64 * 1024**3:
            raise SizeSpecError(f"{part.strip()!r} is out of range (4 bytes to 64G)")
        sizes.append(int(value))
    return sizes


def format_size(n: int) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "all_gather":
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(op)


def algbw_busbw(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) for one operation of `size_bytes` taking `seconds`."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


@dataclass
class SweepPlan:
    ops: dict[str, list[int]]  # op -> sizes in bytes
    warmup: int = 3
    min_iters: int = 3
    max_iters: int = 50
    target_seconds: float = 0.15  # per (op, size), to keep the sweep short


def default_plan(quick: bool, gpu: bool, sizes: list[int] | None = None) -> SweepPlan:
    if sizes:
        return SweepPlan(ops={"all_reduce": sizes, "all_gather": sizes, "broadcast": sizes})
    if quick:
        return SweepPlan(ops={"all_reduce": [64 * 1024**2 if gpu else 1024**2]}, warmup=2, max_iters=10)
    if gpu:
        return SweepPlan(
            ops={
                "all_reduce": [1024**2, 16 * 1024**2, 128 * 1024**2, 512 * 1024**2],
                "all_gather": [16 * 1024**2, 128 * 1024**2],
                "broadcast": [16 * 1024**2, 128 * 1024**2],
            }
        )
    return SweepPlan(
        ops={"all_reduce": [64 * 1024, 1024**2, 8 * 1024**2], "all_gather": [1024**2], "broadcast": [1024**2]}
    )


@dataclass
class Row:
    op: str
    size: int  # bytes, as nccl-tests counts them for the op
    count: int  # float32 elements per rank's input
    iters: int
    time_us: float  # one operation, averaged over iterations and ranks
    algbw: float  # GB/s
    busbw: float  # GB/s
    correct: bool
    wrong_ranks: list[int] = field(default_factory=list)


@dataclass
class BandwidthResult:
    backend: str
    world_size: int
    local_ranks: int
    device: str  # "cuda" | "cpu"
    rows: list[Row] = field(default_factory=list)
    ranks_info: list[dict[str, Any]] = field(default_factory=list)  # host, versions per rank
    local_copy_gbps: float | None = None  # one GPU: device-to-device copy bandwidth
    never_joined: list[int] = field(default_factory=list)  # never reached init_process_group
    waiting_in_init: list[int] = field(default_factory=list)  # reached it, waited for the others
    hung: dict[int, str] = field(default_factory=dict)  # rank -> the collective it was in
    crashed: dict[int, str] = field(default_factory=dict)  # rank -> exit code and last log lines
    timed_out: bool = False
    timeout: float = 0.0
    pids: list[int] = field(default_factory=list)  # this node's worker processes (all reaped)
    elapsed: float = 0.0
    error: str | None = None
    # This node's local rank 0 reads torch for the parent's checks (snapshot.TorchInfo as a dict);
    # when it did not, torch_error says why. Both go to the JSON as system.torch, not here.
    torch: dict[str, Any] | None = None
    torch_error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.never_joined or self.waiting_in_init or self.hung or self.crashed or self.error)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["torch"], data["torch_error"]
        data["hung"] = {str(k): v for k, v in self.hung.items()}
        data["crashed"] = {str(k): v for k, v in self.crashed.items()}
        return data


# -- parent side ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bandwidth_test(
    nprocs: int,
    plan: SweepPlan,
    *,
    backend: str,
    timeout: float = 60.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
) -> BandwidthResult:
    """Start `nprocs` worker processes for this node, wait at most `timeout` s, reap every one.
    Setting `stop` (e.g. on Ctrl-C in the caller) ends the wait early; the workers are killed too."""
    world = nprocs * nnodes
    result = BandwidthResult(
        backend=backend,
        world_size=world,
        local_ranks=nprocs,
        device="cuda" if backend == "nccl" else "cpu",
        timeout=timeout,
    )
    workdir = Path(tempfile.mkdtemp(prefix="sddoctor-bw-"))
    config = {"plan": asdict(plan), "backend": backend, "timeout": timeout, "dir": str(workdir)}
    (workdir / "config.json").write_text(json.dumps(config))
    base_env = dict(os.environ if env is None else env)
    base_env.update(
        MASTER_ADDR=master_addr or "127.0.0.1",
        MASTER_PORT=str(master_port or free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(nprocs),
        OMP_NUM_THREADS=base_env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    # The checkout that runs this module must be the one the workers import.
    root = str(Path(__file__).resolve().parents[2])
    base_env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [base_env.get("PYTHONPATH")])])
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = {}
    start = time.monotonic()
    try:
        for local in range(nprocs):
            rank = node_rank * nprocs + local
            child_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(local))
            logs[rank] = open(workdir / f"rank-{rank}.log", "wb")  # noqa: SIM115 - closed in finally
            procs[rank] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sddoctor.preflight.bandwidth",
                    "--worker",
                    str(workdir / "config.json"),
                ],
                env=child_env,
                stdout=logs[rank],
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed as a whole, never orphaned
            )
        result.pids = [p.pid for p in procs.values()]
        _wait(procs, start + timeout, result, stop)
    finally:
        for proc in procs.values():
            _kill(proc)
        for handle in logs.values():
            handle.close()
    result.elapsed = time.monotonic() - start
    _collect(workdir, procs, result)
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def _wait(
    procs: dict[int, subprocess.Popen[bytes]],
    deadline: float,
    result: BandwidthResult,
    stop: threading.Event | None,
) -> None:
    first_failure: float | None = None
    while True:
        if stop is not None and stop.is_set():
            result.error = STOPPED
            return
        codes = {r: p.poll() for r, p in procs.items()}
        if all(c is not None for c in codes.values()):
            return
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes.values()):
            # The others are waiting for the dead rank inside a collective; give them a moment to
            # fail on their own, then stop them.
            first_failure = first_failure or now
            if now - first_failure > 3.0:
                return
        if now >= deadline:
            result.timed_out = True
            return
        time.sleep(0.05)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


def _collect(workdir: Path, procs: dict[int, subprocess.Popen[bytes]], result: BandwidthResult) -> None:
    _collect_torch(workdir, procs, result)
    results = {}
    for rank, proc in sorted(procs.items()):
        out = workdir / f"rank-{rank}.json"
        if out.exists():
            results[rank] = json.loads(out.read_text())
            continue
        joined = (workdir / f"rank-{rank}.joined").exists()
        progress = _read_text(workdir / f"rank-{rank}.progress") or "setup"
        log_tail = _tail(workdir / f"rank-{rank}.log")
        code = proc.returncode
        killed = code is not None and code < 0 and result.timed_out
        if code not in (0, None) and not killed and code != -signal.SIGKILL:
            result.crashed[rank] = f"exit code {code}" + (f": {log_tail}" if log_tail else "")
        elif not joined and (workdir / f"rank-{rank}.entering").exists():
            result.waiting_in_init.append(rank)
        elif not joined:
            result.never_joined.append(rank)
        else:
            result.hung[rank] = progress
    if not results:
        if not (result.never_joined or result.waiting_in_init or result.hung or result.crashed):
            result.error = "no rank reported a result"
        return
    first = results[min(results)]
    result.rows = [Row(**row) for row in first["rows"]]
    result.ranks_info = first.get("ranks_info", [])
    result.local_copy_gbps = first.get("local_copy_gbps")
    if first.get("error"):
        result.error = first["error"]


def _collect_torch(workdir: Path, procs: dict[int, subprocess.Popen[bytes]], result: BandwidthResult) -> None:
    """The torch facts that this node's local rank 0 wrote, or the reason there are none."""
    if not procs:
        result.torch_error = "no test process was started"
        return
    rank = min(procs)
    text = _read_text(workdir / f"rank-{rank}.torch")
    if text:
        try:
            result.torch = json.loads(text)
            return
        except ValueError as exc:
            result.torch_error = f"rank {rank} wrote unreadable torch facts: {exc}"
            return
    code = procs[rank].returncode
    who = f"the collective test's local rank 0 (rank {rank})"
    if result.error == STOPPED:
        result.torch_error = f"the test was stopped before {who} reported them"
    elif result.timed_out:
        result.torch_error = f"{who} had not reported them after {result.timeout:g} s and was stopped"
    elif code not in (0, None) and code != -signal.SIGKILL:
        tail = _tail(workdir / f"rank-{rank}.log")
        result.torch_error = f"{who} exited with code {code} before reporting them" + (
            f": {tail}" if tail else ""
        )
    elif code == -signal.SIGKILL:
        result.torch_error = f"{who} was stopped before it reported them"
    else:
        result.torch_error = f"{who} ended without reporting them (exit code {code})"


def _tail(path: Path, lines: int = 6) -> str:
    text = _read_text(path) or ""
    keep = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(keep)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


# -- worker side (torch lives here) ---------------------------------------------------------------


def _apply_fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if ":" not in spec:
        return
    kind, _, target = spec.partition(":")
    if not target.isdigit() or int(target) != rank:
        return
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "exit":
        os._exit(3)


def _exit_with_parent() -> None:
    """The workers run in their own sessions (so they can be killed as a group); if the parent dies
    without killing them (SIGKILL, a crash), they notice and leave instead of waiting in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="sddoctor-parent-watch", daemon=True).start()


def worker_main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    workdir = Path(config["dir"])
    rank = int(os.environ["RANK"])
    _exit_with_parent()
    _apply_fault(rank)

    def mark(name: str, text: str = "") -> None:
        tmp = workdir / f"rank-{rank}.{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, workdir / f"rank-{rank}.{name}")

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # The parent's torch checks wait for this instead of importing torch themselves.
        from sddoctor.preflight.snapshot import read_torch

        mark("torch", json.dumps(asdict(read_torch()), default=str))
    plan = SweepPlan(**config["plan"])
    payload = measure(
        plan,
        config["backend"],
        float(config["timeout"]),
        on_enter=lambda: mark("entering"),
        on_join=lambda: mark("joined"),
        on_progress=lambda t: mark("progress", t),
    )
    mark("json", json.dumps(payload))
    return 0


def measure(
    plan: SweepPlan,
    backend: str,
    timeout: float,
    on_enter: Any = None,
    on_join: Any = None,
    on_progress: Any = None,
) -> dict[str, Any]:
    """Join the process group from env:// variables, run the sweep, leave. Returns rows and versions."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = backend == "nccl"
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    if on_enter:
        on_enter()
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    try:
        if on_join:
            on_join()
        info = _rank_info(rank, local, device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, info)
        rows = []
        for op, sizes in plan.ops.items():
            if world == 1 and op != "all_reduce":
                continue  # one rank: all-gather and broadcast move nothing; the local copy says more
            for size in sizes:
                if on_progress:
                    on_progress(f"{op} {format_size(size)}")
                rows.append(asdict(_measure_one(op, size, plan, rank, world, device)))
        copy_gbps = (
            _local_copy_gbps(device, max(max(s) for s in plan.ops.values())) if world == 1 and gpu else None
        )
        if on_progress:
            on_progress("teardown")
        dist.barrier()
        return {"rows": rows, "ranks_info": gathered, "local_copy_gbps": copy_gbps}
    finally:
        dist.destroy_process_group()


def _rank_info(rank: int, local: int, device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "rank": rank,
        "local_rank": local,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "device": str(device),
    }
    if device.type == "cuda":
        try:
            ver = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
            info["gpu"] = torch.cuda.get_device_name(device)
        except Exception:
            pass
    return info


def _measure_one(op: str, size: int, plan: SweepPlan, rank: int, world: int, device: Any) -> Row:
    import torch
    import torch.distributed as dist

    elements = max(1, size // ELEMENT_BYTES)
    if op == "all_gather":
        count = max(1, elements // world)  # nccl-tests' size is the gathered output
        size_bytes = count * world * ELEMENT_BYTES
    else:
        count = elements
        size_bytes = count * ELEMENT_BYTES
    inp = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
    out = torch.empty(count * world, dtype=torch.float32, device=device) if op == "all_gather" else None

    def run_once() -> None:
        if op == "all_reduce":
            dist.all_reduce(inp)
        elif op == "broadcast":
            dist.broadcast(inp, src=0)
        else:
            _all_gather(out, inp, world)

    # One checked operation first (it is also the first warm-up).
    if op == "broadcast":
        inp.fill_(7.0 if rank == 0 else -1.0)
    run_once()
    if op == "all_reduce":
        ok = bool(torch.all(inp == world * (world + 1) / 2).item())
        inp.zero_()  # sums of zeros stay finite through the timed loop
    elif op == "broadcast":
        ok = bool(torch.all(inp == 7.0).item())
    else:
        expect = torch.arange(1, world + 1, dtype=torch.float32, device=device).repeat_interleave(count)
        ok = out is not None and bool(torch.equal(out, expect))
    wrong = torch.zeros(world, dtype=torch.float32, device=device)
    wrong[rank] = 0.0 if ok else 1.0
    dist.all_reduce(wrong)
    wrong_ranks = [i for i, v in enumerate(wrong.tolist()) if v > 0]

    for _ in range(max(0, plan.warmup - 1)):
        run_once()
    probe = _time_loop(run_once, 1, device)
    iters = int(min(plan.max_iters, max(plan.min_iters, plan.target_seconds / max(probe, 1e-6))))
    agreed = torch.tensor([float(iters)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank must run the same number of ops
    iters = int(agreed.item())
    seconds = _time_loop(run_once, iters, device) / iters
    total = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    seconds = float(total.item()) / world
    algbw, busbw = algbw_busbw(op, size_bytes, seconds, world)
    return Row(op, size_bytes, count, iters, seconds * 1e6, algbw, busbw, not wrong_ranks, wrong_ranks)


def _all_gather(out: Any, inp: Any, world: int) -> None:
    import torch.distributed as dist

    try:
        dist.all_gather_into_tensor(out, inp)
    except (RuntimeError, NotImplementedError, AttributeError):
        # Older gloo builds lack the flat variant; the list form moves the same bytes.
        dist.all_gather(list(out.chunk(world)), inp)


def _time_loop(fn: Any, iters: int, device: Any) -> float:
    """Seconds for `iters` calls: CUDA events on GPU, the wall clock (after a barrier) on CPU."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


def _local_copy_gbps(device: Any, size: int) -> float:
    """With one GPU the bus bandwidth of a collective is 0 by definition: measure a device copy
    instead (bytes copied / time; the memory moves 2x that: one read and one write)."""
    import torch

    src = torch.empty(max(1, size // ELEMENT_BYTES), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    iters = 20
    seconds = _time_loop(lambda: dst.copy_(src), iters, device) / iters
    return src.numel() * ELEMENT_BYTES / seconds / 1e9


def run_inline(plan: SweepPlan, backend: str, timeout: float) -> BandwidthResult:
    """Under torchrun this process is one rank: measure here, with a watchdog instead of a parent."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = BandwidthResult(
        backend=backend,
        world_size=world,
        local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device="cuda" if backend == "nccl" else "cpu",
        timeout=timeout,
    )
    state = {"where": "joining the process group"}
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout):
            sys.stderr.write(
                f"sddoctor check-nccl: rank {rank} did not finish within {timeout:g} s "
                f"(stuck in {state['where']}); exiting\n"
            )
            sys.stderr.flush()
            os._exit(2)

    threading.Thread(target=watchdog, daemon=True).start()
    start = time.monotonic()
    try:
        payload = measure(plan, backend, timeout, on_progress=lambda t: state.update(where=t))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        done.set()
    result.elapsed = time.monotonic() - start
    result.rows = [Row(**r) for r in payload["rows"]]
    result.ranks_info = payload["ranks_info"]
    result.local_copy_gbps = payload["local_copy_gbps"]
    return result


def format_bandwidth(result: BandwidthResult) -> str:
    """An nccl-tests style table."""
    head = (
        f"# collective test: {result.backend} on {result.device}, {result.world_size} rank(s)"
        f" ({result.local_ranks} on this node), float32, time averaged over iterations and ranks,"
        f" took {result.elapsed:.1f} s"
    )
    lines = [
        head,
        f"# {'size':>10}  {'op':<10}  {'count':>10}  {'iters':>5}  {'time(us)':>10}  "
        f"{'algbw(GB/s)':>11}  {'busbw(GB/s)':>11}  check",
    ]
    for r in result.rows:
        check = "ok" if r.correct else f"WRONG on ranks {r.wrong_ranks}"
        lines.append(
            f"  {r.size:>10}  {r.op:<10}  {r.count:>10}  {r.iters:>5}  {r.time_us:>10.1f}  "
            f"{r.algbw:>11.2f}  {r.busbw:>11.2f}  {check}"
        )
    if result.world_size == 1:
        lines.append("# one rank: busbw is 0 by definition (factor 2(n-1)/n); algbw is the local cost")
    if result.local_copy_gbps is not None:
        lines.append(
            f"# device-local copy bandwidth: {result.local_copy_gbps:.1f} GB/s (bytes copied per second)"
        )
    if not result.rows:
        lines.append("#  (no measurement)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--worker":
        print(
            "usage: python -m sddoctor.preflight.bandwidth --worker CONFIG.json (started by check-nccl)",
            file=sys.stderr,
        )
        return 64
    return worker_main(args[1])


if __name__ == "__main__":
    sys.exit(main())
