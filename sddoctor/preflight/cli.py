"""`sddoctor check-nccl`: the command line around `sddoctor.preflight.api`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from sddoctor import exitcodes
from sddoctor.preflight.findings import (
    EXIT_FAIL,
    Finding,
    exit_code,
    format_findings,
    sort_findings,
    worst_severity,
)
from sddoctor.telemetry.redact import redact_env

EXIT_USAGE = exitcodes.USAGE
EXIT_INTERRUPTED = exitcodes.INTERRUPTED
JSON_SCHEMA = "sddoctor.check-nccl/1"

EPILOG = """\
examples:
  sddoctor check-nccl                      checks + short bandwidth sweep (< 30 s on 8 GPUs)
  sddoctor check-nccl --quick              checks + one all-reduce size (< 5 s)
  sddoctor check-nccl --sizes 1M,64M,1G    all-reduce, all-gather, broadcast at these sizes
  sddoctor check-nccl --no-bandwidth       checks only
  sddoctor check-nccl --json > preflight.json
  # two nodes, 8 GPUs each (run on each node; node 0's address):
  sddoctor check-nccl --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 \\
      -m sddoctor check-nccl

{exit_codes}

Findings, remedies and the --json schema: docs/check-nccl.md.
""".format(exit_codes=exitcodes.help_block("check-nccl"))


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line naming the problem and the fix, then exit 2
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="sddoctor check-nccl",
        description="Preflight of GPUs, topology, NCCL settings and network, then a real collective "
        "bandwidth test (one process per GPU; gloo with 2 processes when there is no GPU).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="checks and one all-reduce size")
    p.add_argument("--sizes", help="comma list of sizes in bytes, K/M/G suffixes (e.g. 1M,64M,1G)")
    p.add_argument("--no-bandwidth", action="store_true", help="run the checks only, no collective test")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before a rank that has not finished is "
        "reported as hung and stopped (default 60, --quick 20)",
    )
    p.add_argument("--backend", choices=("nccl", "gloo"), help="force a backend (default: nccl with GPUs)")
    p.add_argument("--nproc-per-node", type=int, help="test processes on this node (default: one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes taking part (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument("--master-addr", help="node 0's address (default: $MASTER_ADDR; 127.0.0.1 on one node)")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: $MASTER_PORT)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON document (schema in docs/check-nccl.md)"
    )
    p.add_argument("--all", action="store_true", help="also list ok findings in the table")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        sizes = _validate(args)
    except UsageError as exc:
        print(f"sddoctor check-nccl: {exc}\n(see `sddoctor check-nccl --help`)", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    timeout = args.timeout or (20.0 if args.quick else 60.0)
    from sddoctor.preflight.api import under_torchrun

    if under_torchrun():
        return _main_torchrun(args, sizes, timeout)
    from sddoctor.preflight.api import run_check

    started = time.monotonic()
    stop = threading.Event()
    restore = _stop_on_signals(stop)
    try:
        report = _run(args, sizes, timeout, stop, run_check)
    finally:
        restore()
    if stop.is_set():
        print("sddoctor check-nccl: interrupted; every test process was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    code = exit_code(report.findings)
    if args.json:
        doc = to_json(report, code, time.monotonic() - started)
        print(json.dumps(doc, indent=2, default=str))
        return code
    print(_render(report.findings, report.bandwidth, args, code, report.snapshot.host))
    return code


def _stop_on_signals(stop: threading.Event) -> Any:
    """Ctrl-C or SIGTERM sets `stop` instead of raising wherever the main thread happens to be (a
    KeyboardInterrupt inside a C extension's import can be lost); the test processes are then
    killed and reaped by the runner. Returns a function that puts the old handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in old:
        signal.signal(sig, lambda _signum, _frame: stop.set())

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


def _run(
    args: argparse.Namespace, sizes: list[int] | None, timeout: float, stop: threading.Event, run_check: Any
) -> Any:
    return run_check(
        quick=args.quick,
        collective=not args.no_bandwidth,
        sizes=sizes,
        timeout=timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        backend=args.backend,
        nproc=args.nproc_per_node,
        stop=stop,
    )


def _validate(args: argparse.Namespace) -> list[int] | None:
    from sddoctor.preflight.bandwidth import SizeSpecError, parse_sizes

    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be 1 or more, not {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be between 0 and {args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be a positive number of seconds")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UsageError("--nproc-per-node must be 1 or more")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port {args.master_port} is not a TCP port (1-65535)")
    if args.nnodes > 1 and not (args.master_addr or os.environ.get("MASTER_ADDR")):
        raise UsageError("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if args.nnodes > 1 and not (args.master_port or os.environ.get("MASTER_PORT")):
        raise UsageError("--nnodes > 1 needs --master-port (the same on every node)")
    if args.sizes and args.quick:
        raise UsageError("--quick measures one size; drop --quick to use --sizes")
    if args.sizes and args.no_bandwidth:
        raise UsageError("--sizes has no effect with --no-bandwidth")
    if not args.sizes:
        return None
    try:
        return parse_sizes(args.sizes)
    except SizeSpecError as exc:
        raise UsageError(f"--sizes: {exc}") from None


def _render(findings: list[Finding], bandwidth: Any, args: argparse.Namespace, code: int, host: str) -> str:
    color = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    )
    shown = findings if args.all else [f for f in findings if f.severity != "ok"] or findings
    hidden = len(findings) - len(shown)
    parts = [f"sddoctor check-nccl on {host}", "", format_findings(shown, color=color).rstrip()]
    if hidden:
        parts.append(f"({hidden} ok finding(s) hidden; --all shows them)")
    if bandwidth is not None:
        from sddoctor.preflight.bandwidth import format_bandwidth

        parts += ["", format_bandwidth(bandwidth).rstrip()]
    verdict = {exitcodes.OK: "OK", exitcodes.WARNINGS: "WARNINGS", exitcodes.FINDINGS: "FAILURES"}[code]
    parts += ["", f"result: {verdict} (exit {code})"]
    return "\n".join(parts)


def to_json(report: Any, code: int, elapsed: float) -> dict[str, Any]:
    from dataclasses import asdict

    from sddoctor import __version__

    snap = report.snapshot
    topo = snap.topology
    return {
        "schema": JSON_SCHEMA,
        "sddoctor_version": __version__,
        "host": snap.host,
        "time": time.time(),
        "elapsed_s": round(elapsed, 3),
        "exit_code": code,
        "worst": worst_severity(report.findings),
        "findings": [f.to_dict() for f in sort_findings(report.findings)],
        "bandwidth": report.bandwidth.to_dict() if report.bandwidth is not None else None,
        "system": {
            "platform": snap.platform,
            "in_container": snap.in_container,
            "nnodes": snap.nnodes,
            "node_rank": snap.node_rank,
            "driver_version": topo.driver_version,
            "cuda_driver_version": topo.cuda_driver_version,
            "gpus": [asdict(g) for g in topo.gpus],
            "pairs": [dict(asdict(p), label=p.label) for p in topo.pairs],
            "torch": asdict(snap.torch),
            "env": redact_env(snap.env),
            "shm_bytes": snap.shm_total,
            "memlock": snap.memlock,
            "nofile": snap.nofile,
            "interfaces": [dict(asdict(i), kind=i.kind) for i in snap.interfaces],
            "rdma": [asdict(d) for d in snap.rdma],
            "master": asdict(snap.master),
            "iommu": asdict(snap.pci.iommu),
        },
    }


def _main_torchrun(args: argparse.Namespace, sizes: list[int] | None, timeout: float) -> int:
    """Under torchrun every process is one rank: local rank 0 runs the checks, every rank measures,
    rank 0 prints the bandwidth table. Each rank exits with its own worst severity."""
    from sddoctor.preflight import bandwidth as bw
    from sddoctor.preflight.api import bandwidth_findings
    from sddoctor.preflight.checks import run_checks
    from sddoctor.preflight.snapshot import collect_snapshot

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    nnodes = max(
        1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    findings: list[Finding] = []
    snap = None
    if local == 0:
        snap = collect_snapshot(nnodes=nnodes, node_rank=int(os.environ.get("GROUP_RANK", "0")))
        findings = run_checks(snap)
    result = None
    if not args.no_bandwidth:
        import torch

        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        plan = bw.default_plan(args.quick, backend == "nccl", sizes)
        result = bw.run_inline(plan, backend, timeout)
        if snap is not None:
            findings += bandwidth_findings(result, snap)
    code = exit_code(findings) if findings else (EXIT_FAIL if result is not None and not result.ok else 0)
    if local == 0:
        if args.json:
            print(
                json.dumps(
                    {
                        "schema": JSON_SCHEMA,
                        "rank": rank,
                        "exit_code": code,
                        "findings": [f.to_dict() for f in sort_findings(findings)],
                        "bandwidth": result.to_dict() if result and rank == 0 else None,
                    },
                    default=str,
                )
            )
        else:
            print(_render(findings, result if rank == 0 else None, args, code, snap.host if snap else "?"))
    return code
