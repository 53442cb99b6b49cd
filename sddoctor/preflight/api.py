"""The preflight as a Python call: `run_preflight()` for `sddoctor run --preflight` and the trainer,
`run_check()` for the CLI (findings plus the bandwidth result and the snapshot).

Nothing here imports torch at module import. When a collective test runs, this process never imports
torch: the test's local rank 0 reads torch's versions and devices and the checks wait for them (one
torch import instead of two competing ones). Without a test, the snapshot reader imports it here.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from sddoctor.gpu.topology import count_gpus, expected_busbw_gbps
from sddoctor.preflight import bandwidth as bw
from sddoctor.preflight.checks import run_checks
from sddoctor.preflight.findings import Finding, format_findings
from sddoctor.preflight.snapshot import (
    TEST_WORKER_SOURCE,
    MasterInfo,
    SystemSnapshot,
    TorchInfo,
    collect_snapshot,
    master_target,
    read_env,
    read_master,
    read_torch,
    started_by_launcher,
    torch_info_from_dict,
    torch_not_reported,
)

__all__ = ["run_preflight", "run_check", "format_findings", "PreflightReport", "bandwidth_findings"]


@dataclass
class PreflightReport:
    snapshot: SystemSnapshot
    findings: list[Finding] = field(default_factory=list)
    bandwidth: bw.BandwidthResult | None = None


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def choose_workers(
    gpus: int, visible_devices: str | None, backend: str | None, nproc: int | None
) -> tuple[str, int]:
    """nccl with one process per visible GPU; gloo with 2 processes when there is no GPU.
    `gpus` is NVML's count, `visible_devices` CUDA_VISIBLE_DEVICES (None when unset)."""
    if visible_devices is not None:
        gpus = min(gpus, len([e for e in visible_devices.split(",") if e.strip()]))
    chosen = backend or ("nccl" if gpus else "gloo")
    if nproc:
        return chosen, nproc
    return chosen, (max(gpus, 1) if chosen == "nccl" else 2)


def torch_from_test(result: bw.BandwidthResult) -> TorchInfo:
    """The torch facts the collective test's local rank 0 sent, or an `unknown` TorchInfo saying why
    there are none (the torch checks then say so instead of passing or crashing)."""
    if result.torch is not None:
        return torch_info_from_dict(result.torch, TEST_WORKER_SOURCE)
    return torch_not_reported(result.torch_error or result.error or "the test process sent nothing")


def run_check(
    *,
    quick: bool = False,
    collective: bool = True,
    sizes: list[int] | None = None,
    timeout: float = 60.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    nproc: int | None = None,
    stop: threading.Event | None = None,
) -> PreflightReport:
    """Checks and (unless collective=False) the collective test, run side by side: the test's
    processes start first (they take longest: importing torch), the system is read while they run,
    and the checks are evaluated once the test's torch facts are in.
    Setting `stop` (a signal handler may) ends the collective test early; its processes are reaped."""
    holder: dict[str, bw.BandwidthResult] = {}
    thread: threading.Thread | None = None
    stop = stop or threading.Event()
    master: MasterInfo | None = None
    if collective:
        thread, master = _start_collective_test(
            holder,
            quick=quick,
            sizes=sizes,
            timeout=timeout,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            nproc=nproc,
            stop=stop,
        )
    try:
        snap = collect_snapshot(
            master_addr=master_addr,
            master_port=master_port,
            nnodes=nnodes,
            node_rank=node_rank,
            with_torch=False,
            master=master,
        )
        if thread is not None:
            while thread.is_alive():  # join in slices so Ctrl-C gets through
                thread.join(0.2)
    except BaseException:
        stop.set()  # the runner kills and reaps its workers before the thread ends
        if thread is not None:
            thread.join()
        raise
    report = PreflightReport(snapshot=snap)
    if thread is None:  # no test process: read torch here
        snap.torch = read_torch()
    elif "result" not in holder:  # the runner itself raised; the thread's traceback is on stderr
        snap.torch = torch_not_reported("the collective test ended without a result")
    else:
        snap.torch = torch_from_test(holder["result"])
    report.findings = run_checks(snap)
    if "result" in holder:
        report.bandwidth = holder["result"]
        report.findings.extend(bandwidth_findings(report.bandwidth, snap))
        if report.bandwidth.ok and report.bandwidth.rows:
            _master_reached_by_test(report.findings, snap)
    return report


def _start_collective_test(
    holder: dict[str, bw.BandwidthResult],
    *,
    quick: bool,
    sizes: list[int] | None,
    timeout: float,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    backend: str | None,
    nproc: int | None,
    stop: threading.Event,
) -> tuple[threading.Thread | None, MasterInfo | None]:
    """Start the collective test in a thread that puts its result in `holder["result"]`; return
    the thread (None when the test cannot run: its result is already in `holder`) and MASTER_ADDR's
    port as seen before the test's rank 0 took it (None when not looked at)."""
    master: MasterInfo | None = None
    env = read_env(os.environ)
    chosen, procs = choose_workers(count_gpus(), env.get("CUDA_VISIBLE_DEVICES"), backend, nproc)
    plan = bw.default_plan(quick, chosen == "nccl", sizes)
    addr, port = master_target(env, master_addr, master_port)
    test_addr = master_addr or (addr if nnodes > 1 else None)
    test_port = master_port or (port if nnodes > 1 else None)
    if test_port is not None and node_rank == 0:
        # The test's rank 0 listens on this port: look at it before the test takes it.
        master = read_master(addr, port, started_by_launcher(env), node_rank=node_rank)
    if nnodes > 1 and not test_addr:
        holder["result"] = bw.BandwidthResult(
            backend=chosen,
            world_size=procs * nnodes,
            local_ranks=procs,
            device="?",
            error="several nodes need --master-addr and --master-port",
        )
        return None, master

    def work() -> None:
        holder["result"] = bw.run_bandwidth_test(
            procs,
            plan,
            backend=chosen,
            timeout=timeout,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=test_addr,
            master_port=test_port,
            stop=stop,
        )

    thread = threading.Thread(target=work, name="sddoctor-bandwidth", daemon=True)
    thread.start()
    return thread, master


def _master_reached_by_test(findings: list[Finding], snap: SystemSnapshot) -> None:
    """Node 0 may not have listened yet when this node looked; the test has since joined it."""
    for i, f in enumerate(findings):
        if f.id == "master.unreachable":
            findings[i] = Finding(
                "master.ok",
                "ok",
                f"MASTER_ADDR {snap.master.addr}:{snap.master.port} was reached by the collective test",
                [*f.evidence, f"first attempt: {snap.master.reach_error}"],
            )


def run_preflight(
    quick: bool = True,
    *,
    collective: bool = False,
    sizes: list[int] | None = None,
    timeout: float = 30.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> list[Finding]:
    """The preflight findings (worst first is up to `format_findings`).

    collective=False (the default) runs the checks only: this is what a training rank calls at
    start, where spawning one test process per GPU would compete with the job itself.
    `sddoctor run --preflight` runs before the job starts and passes collective=True.
    """
    try:
        report = run_check(
            quick=quick,
            collective=collective,
            sizes=sizes,
            timeout=timeout,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
        )
    except Exception as exc:  # a preflight must never be the thing that stops a training job
        return [
            Finding(
                "internal.preflight",
                "warn",
                f"the preflight itself failed: {type(exc).__name__}: {exc}",
                [],
                "Please report this with `sddoctor check-nccl --json` output.",
            )
        ]
    return report.findings


def bandwidth_findings(result: bw.BandwidthResult, snap: SystemSnapshot) -> list[Finding]:
    """What the collective test says: its failures, whether the ranks run the same versions, and
    the all-reduce bandwidth against what the links should give."""
    findings = _test_failures(result)
    findings += _version_findings(result)
    findings += _speed_findings(result, snap)
    return findings


def _test_failures(result: bw.BandwidthResult) -> list[Finding]:
    """The test could not run, a rank died, it hung, or a collective returned wrong data."""
    findings: list[Finding] = []
    if result.error and not result.rows:
        findings.append(
            Finding("bw.error", "fail", f"the collective test could not run: {result.error}", [], _BW_REMEDY)
        )
    if result.crashed:
        findings.append(
            Finding(
                "bw.crash",
                "fail",
                f"rank(s) {', '.join(map(str, sorted(result.crashed)))} of the collective test died",
                [f"rank {r}: {msg}" for r, msg in sorted(result.crashed.items())],
                "Read the rank's last lines above. 'unhandled system error' or a bus error: see shm.size; "
                "'no socket interface': see nccl.env.ifname_missing; rerun with NCCL_DEBUG=INFO for details.",
            )
        )
    if result.never_joined or result.waiting_in_init or result.hung:
        findings.append(_hang_finding(result))
    wrong = [r for r in result.rows if not r.correct]
    if wrong:
        findings.append(
            Finding(
                "bw.wrong_result",
                "fail",
                "collectives returned wrong data: training would silently diverge",
                [f"{r.op} {bw.format_size(r.size)}: wrong on rank(s) {r.wrong_ranks}" for r in wrong],
                "Usually broken PCIe P2P (GeForce cards, ACS, IOMMU): set NCCL_P2P_DISABLE=1 and rerun; "
                "update the driver; check for Xid errors in dmesg.",
            )
        )
    return findings


def _hang_finding(result: bw.BandwidthResult) -> Finding:
    """The test did not finish: which ranks never joined, waited in init, or are stuck where."""
    ev = []
    if result.never_joined:
        ev.append(f"never reached init_process_group: rank(s) {', '.join(map(str, result.never_joined))}")
    if result.waiting_in_init:
        ev.append(
            "waited in init_process_group for the others: rank(s) "
            + ", ".join(map(str, result.waiting_in_init))
        )
    ev += [f"rank {r} joined, stuck in {where}" for r, where in sorted(result.hung.items())]
    culprit = result.never_joined or (result.waiting_in_init if not result.hung else sorted(result.hung))
    return Finding(
        "bw.hang",
        "fail",
        f"the collective test did not finish within {result.timeout:g} s; "
        f"look first at rank(s) {', '.join(map(str, culprit))}",
        ev,
        "Ranks that never joined: a process that did not start or is stuck before "
        "init_process_group (or, across nodes, a node that is not running / cannot reach "
        "MASTER_ADDR). Ranks stuck inside a collective: P2P/ACS/IOMMU (see pcie.acs_enabled, "
        "iommu.translated; try NCCL_P2P_DISABLE=1) or a network that drops traffic "
        "(NCCL_SOCKET_IFNAME). All processes were stopped.",
    )


def _version_findings(result: bw.BandwidthResult) -> list[Finding]:
    """Whether every rank of the test runs the same torch / NCCL / CUDA."""
    n = result.world_size
    hosts: dict[tuple[object, object, object], set[str]] = {}
    for info in result.ranks_info:
        if isinstance(info, dict):
            key = (info.get("torch"), info.get("nccl"), info.get("cuda"))
            hosts.setdefault(key, set()).add(str(info.get("host")))
    if len(hosts) > 1:
        return [
            Finding(
                "nodes.version_mismatch",
                "fail",
                "ranks run different torch / NCCL / CUDA versions: NCCL may hang or fail across them",
                [f"torch {k[0]}, NCCL {k[1]}, CUDA {k[2]}: {', '.join(sorted(v))}" for k, v in hosts.items()],
                "Install the same torch build (and so the same bundled NCCL) on every node; a shared "
                "container image is the easy way.",
            )
        ]
    if len(hosts) == 1 and n > 1:
        ((key, names),) = hosts.items()
        return [
            Finding(
                "nodes.versions",
                "ok",
                f"all {n} ranks on {len(names)} host(s) run torch {key[0]}, NCCL {key[1] or '-'}",
                [", ".join(sorted(names))],
            )
        ]
    return []


def _speed_findings(result: bw.BandwidthResult, snap: SystemSnapshot) -> list[Finding]:
    """The largest correct all-reduce: one rank, gloo, or NCCL judged against the topology."""
    n = result.world_size
    ar = [r for r in result.rows if r.op == "all_reduce" and r.correct]
    if not ar:
        return []
    top = max(ar, key=lambda r: r.size)
    summary = f"all_reduce {bw.format_size(top.size)}: algbw {top.algbw:.2f} GB/s, busbw {top.busbw:.2f} GB/s"
    if n == 1:
        copy = f"; device-local copy {result.local_copy_gbps:.0f} GB/s" if result.local_copy_gbps else ""
        return [
            Finding(
                "bw.single_rank",
                "info",
                "one rank: all-reduce busbw is 0 by definition (2(n-1)/n), nothing crosses a link" + copy,
                [summary],
                "Run with two or more GPUs to measure GPU-to-GPU bandwidth.",
            )
        ]
    if result.backend != "nccl":
        return [
            Finding(
                "bw.result",
                "info",
                f"gloo on CPU works ({n} ranks): {summary}",
                ["these numbers measure CPU and loopback speed, not NCCL"],
                "",
            )
        ]
    expected, why = (
        expected_busbw_gbps(snap.topology) if result.world_size == result.local_ranks else (None, "")
    )
    if expected and top.size >= bw.JUDGE_MIN_BYTES and top.busbw < bw.LOW_FRACTION * expected:
        return [
            Finding(
                "bw.low",
                "warn",
                f"all-reduce busbw {top.busbw:.1f} GB/s is below half of the ~{expected:.0f} GB/s the links "
                "should give",
                [summary, f"expected from: {why}"],
                "Check the pairs in topo.matrix (P2P off? SYS links?), NCCL_P2P_DISABLE / NCCL_SHM_DISABLE, "
                "ACS/IOMMU findings, GPU clocks/throttling (sddoctor tui), and other jobs on the GPUs.",
            )
        ]
    note = f"expected ~{expected:.0f} GB/s ({why})" if expected else "no reference for this topology"
    return [Finding("bw.result", "ok", f"NCCL works ({n} ranks): {summary}", [note])]


_BW_REMEDY = "Fix the failing findings above (torch, GPUs, MASTER_ADDR), then rerun."
