"""The preflight checks: pure functions from a `SystemSnapshot` to findings.

Every finding id produced here is listed with its meaning and remedy in docs/check-nccl.md.
"""

from __future__ import annotations

from collections.abc import Callable

from sddoctor.gpu.pci_sysfs import ACS_P2P_REDIRECT_BITS
from sddoctor.gpu.topology import Gpu, expected_busbw_gbps, expected_pair_gbps, normalise_bus_id
from sddoctor.preflight.findings import Finding
from sddoctor.preflight.nccl_vars import (
    KNOWN_NCCL_VARS,
    NOT_SETTINGS,
    REMOVED_NCCL_VARS,
    TORCH_RENAMED_VARS,
    closest_nccl_var,
)
from sddoctor.preflight.snapshot import NetInterface, SystemSnapshot, TorchInfo

Check = Callable[[SystemSnapshot], list[Finding]]

MIB = 1024 * 1024
GIB = 1024 * MIB
SHM_FAIL_BELOW = 256 * MIB  # Docker's 64 MiB default is far below what NCCL's SHM transport maps
SHM_WARN_BELOW = 1 * GIB
NOFILE_WARN_BELOW = 4096

P2P_ISSUES = "NVIDIA/nccl issues 199, 257, 606, 2079"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _gpu_count(s: SystemSnapshot) -> int:
    return len(s.topology.gpus) if s.topology.available else len(s.torch.devices)


# -- GPUs, driver, torch -------------------------------------------------------------------------


def check_gpus(s: SystemSnapshot) -> list[Finding]:
    unusable = _no_usable_gpu(s)
    if unusable:
        return unusable
    topo = s.topology
    names = [g.name for g in topo.gpus]
    findings = [
        Finding(
            "gpu.inventory",
            "ok",
            f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}; driver {topo.driver_version}, "
            f"driver supports CUDA {topo.cuda_driver_version}",
            [f"GPU{g.index} {g.name} {g.bus_id} {g.uuid}" for g in topo.gpus],
        )
    ]
    if len(set(names)) > 1:
        findings.append(
            Finding(
                "gpu.mixed_models",
                "warn",
                "GPUs of different models: collectives run at the speed of the slowest, and CUDA's "
                "default FASTEST_FIRST order differs from nvidia-smi's",
                [f"GPU{g.index}: {g.name}" for g in topo.gpus],
                "Train on one model only: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=<the same-model GPUs>.",
            )
        )
    return findings + _pcie_link_findings(s)


def _no_usable_gpu(s: SystemSnapshot) -> list[Finding]:
    """Why NVML gives no GPU to check (the driver is not loaded, NVML is missing, it lists none);
    empty when it does."""
    topo = s.topology
    if not topo.available and s.pci.gpus:
        return [
            Finding(
                "gpu.driver_not_loaded",
                "fail",
                f"{len(s.pci.gpus)} NVIDIA GPU(s) sit on the PCIe bus but NVML cannot use them",
                [f"PCI {', '.join(s.pci.gpus[:8])}", topo.error or "unknown reason"],
                "Load the NVIDIA driver (`nvidia-smi` must work; check `dmesg | grep -i nvrm` for Xid or "
                "version-mismatch errors); in a container start it with --gpus all.",
            )
        ]
    if not topo.available:
        sev = "warn" if s.torch.cuda_available else "info"
        return [
            Finding(
                "gpu.nvml_unavailable",
                sev,
                "NVML cannot be read: no NVIDIA GPU checks (the collective test uses gloo on CPU)"
                if sev == "info"
                else "NVML cannot be read although torch sees CUDA devices",
                [topo.error or "unknown reason"],
                "Install the NVIDIA driver and nvidia-ml-py; in a container run with --gpus all "
                "(NVIDIA Container Toolkit) so libnvidia-ml.so is mounted.",
            )
        ]
    if not topo.gpus:
        return [
            Finding(
                "gpu.none",
                "warn",
                "NVML works but lists no GPU",
                [f"driver {topo.driver_version}"],
                "Check `nvidia-smi`; in a container pass the GPUs (--gpus all / NVIDIA_VISIBLE_DEVICES).",
            )
        ]
    return []


def _pcie_link_findings(s: SystemSnapshot) -> list[Finding]:
    """GPUs whose PCIe link runs narrower, or at a lower generation, than it can."""
    findings: list[Finding] = []
    topo = s.topology
    narrow = [g for g in topo.gpus if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max]
    if narrow:
        findings.append(
            Finding(
                "gpu.pcie_width_degraded",
                "warn",
                f"{len(narrow)} GPU(s) run their PCIe link narrower than the slot allows",
                [f"GPU{g.index} {g.bus_id}: x{g.pcie_width} of x{g.pcie_width_max}" for g in narrow],
                "Reseat the card or riser, use a full x16 slot, check BIOS lane bifurcation; "
                "host-device and PCIe P2P bandwidth scale with the width.",
            )
        )
    slow = [g for g in topo.gpus if g.pcie_gen and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max]
    if slow:
        findings.append(
            Finding(
                "gpu.pcie_gen_below_max",
                "info",
                f"{len(slow)} GPU(s) run PCIe below their top generation right now (idle GPUs lower "
                "the link speed to save power; under load it should rise)",
                [f"GPU{g.index} {g.bus_id}: gen{g.pcie_gen} of gen{g.pcie_gen_max}" for g in slow],
                "Only a concern if it stays low under load: `nvidia-smi -q -d PCIE` during training; "
                "check the BIOS PCIe speed setting and risers.",
            )
        )
    return findings


#: What cannot be checked without torch's versions and devices.
TORCH_DEPENDENT = (
    "torch.cpu_build, torch.cuda_newer_than_driver, torch.cuda_unavailable, torch.no_nccl, "
    "torch.gpu_mismatch, cuda.device_order (torch's cuda:N order)"
)


def check_torch(s: SystemSnapshot) -> list[Finding]:
    t = s.torch
    if t.unknown or not t.available:
        return [_torch_unusable(t)]
    gpus = _gpu_count(s)
    findings = [
        Finding(
            "torch.versions",
            "ok",
            f"torch {t.version}, CUDA {t.cuda_version or '- (CPU build)'}, NCCL {t.nccl_version or '-'}",
            [
                f"backends: nccl={'yes' if t.nccl_available else 'no'} gloo={'yes' if t.gloo_available else 'no'}",
                f"torch sees {len(t.devices)} CUDA device(s)",
                f"read by {t.source}",
            ],
        )
    ]
    if gpus and not t.cuda_version:
        findings.append(
            Finding(
                "torch.cpu_build",
                "fail",
                f"this torch is a CPU-only build but the machine has {gpus} GPU(s)",
                [f"torch {t.version}"],
                "Install a CUDA build of PyTorch (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu124, or the CUDA version your driver supports).",
            )
        )
        return findings
    findings += _torch_cuda_against_driver(s)
    findings += _torch_cuda_usable(s, gpus)
    return findings


def _torch_unusable(t: TorchInfo) -> Finding:
    """torch's facts are unknown (the process that reads them ended first) or torch is missing."""
    if t.unknown:
        return Finding(
            "torch.not_reported",
            "warn",
            f"torch's versions and devices are unknown: {t.source}, which reads them, ended first",
            [t.error or "no reason given", f"not checked: {TORCH_DEPENDENT}"],
            "Fix what stopped the collective test (the bw.* findings and the rank's log lines), or "
            "run `sddoctor check-nccl --no-bandwidth`, which reads torch in its own process.",
        )
    return Finding(
        "torch.missing",
        "fail",
        "torch cannot be imported: no collective test possible",
        [t.error or "unknown", f"tried in {t.source}"],
        "Install PyTorch (https://pytorch.org/get-started) in this environment.",
    )


def _torch_cuda_against_driver(s: SystemSnapshot) -> list[Finding]:
    """torch's CUDA version against the newest the driver supports."""
    t = s.torch
    findings: list[Finding] = []
    driver_cuda = s.topology.cuda_driver_version
    if t.cuda_version and driver_cuda:
        tmaj, tmin = (int(x) for x in t.cuda_version.split(".")[:2])
        dmaj, dmin = (int(x) for x in driver_cuda.split(".")[:2])
        if tmaj > dmaj:
            findings.append(
                Finding(
                    "torch.cuda_newer_than_driver",
                    "fail",
                    f"torch is built for CUDA {t.cuda_version} but the driver supports only CUDA {driver_cuda}",
                    [f"driver {s.topology.driver_version}"],
                    "Update the NVIDIA driver, or install a torch build for an older CUDA.",
                )
            )
        elif tmaj == dmaj and tmin > dmin:
            findings.append(
                Finding(
                    "torch.cuda_newer_than_driver",
                    "info",
                    f"torch's CUDA {t.cuda_version} is newer than the driver's CUDA {driver_cuda} "
                    "(minor-version compatibility usually works)",
                    [f"driver {s.topology.driver_version}"],
                    "If kernels fail with 'PTX was compiled with an unsupported toolchain', update the driver.",
                )
            )
    return findings


def _torch_cuda_usable(s: SystemSnapshot, gpus: int) -> list[Finding]:
    """The machine has GPUs: torch must be able to use CUDA, and NCCL with it."""
    t = s.torch
    findings: list[Finding] = []
    if gpus and not t.cuda_available:
        findings.append(
            Finding(
                "torch.cuda_unavailable",
                "fail",
                f"NVML sees {gpus} GPU(s) but torch.cuda.is_available() is False",
                [
                    t.cuda_error or "torch gave no reason",
                    f"CUDA_VISIBLE_DEVICES={s.env.get('CUDA_VISIBLE_DEVICES')!r}",
                ],
                "Read the reason above: usually a driver older than torch's CUDA, CUDA_VISIBLE_DEVICES "
                "hiding every GPU, or a container started without --gpus.",
            )
        )
    if gpus and t.cuda_available and not t.nccl_available:
        findings.append(
            Finding(
                "torch.no_nccl",
                "fail",
                "torch was built without NCCL: multi-GPU DDP must fall back to gloo",
                [f"torch {t.version}"],
                "Install an official CUDA build of PyTorch from pytorch.org (it bundles NCCL).",
            )
        )
    return findings


def _visible_entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def check_cuda_visible(s: SystemSnapshot) -> list[Finding]:
    env = s.env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    gpus = s.topology.gpus if s.topology.available else []
    findings: list[Finding] = []
    if cvd is not None and gpus:
        findings += _visible_devices_findings(cvd, order, gpus)
    findings += _torch_device_order(s, gpus, order)
    findings += _torch_gpu_count(s, gpus, cvd)
    return findings


def _visible_devices_findings(cvd: str, order: str, gpus: list[Gpu]) -> list[Finding]:
    """CUDA_VISIBLE_DEVICES against NVML's GPUs: empty, naming GPUs that do not exist, or indices
    whose meaning depends on CUDA_DEVICE_ORDER."""
    entries = _visible_entries(cvd)
    bad = []
    for e in entries:
        if e.lstrip("-").isdigit():
            if int(e) < 0 or int(e) >= len(gpus):
                bad.append(e)
        elif e.startswith(("GPU-", "MIG-")):
            if not any(g.uuid.startswith(e) for g in gpus) and e.startswith("GPU-"):
                bad.append(e)
        else:
            bad.append(e)
    if not entries:
        return [
            Finding(
                "cuda.visible_devices_invalid",
                "fail",
                "CUDA_VISIBLE_DEVICES is empty: every GPU is hidden",
                [f"CUDA_VISIBLE_DEVICES={cvd!r}"],
                "Unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. 0,1,2,3).",
            )
        ]
    if bad:
        return [
            Finding(
                "cuda.visible_devices_invalid",
                "fail",
                f"CUDA_VISIBLE_DEVICES names GPUs that do not exist: {', '.join(bad)}",
                [
                    f"CUDA_VISIBLE_DEVICES={cvd!r}",
                    f"this machine has {len(gpus)} GPU(s), indices 0-{len(gpus) - 1}",
                ],
                "CUDA stops at the first invalid entry and hides the rest: list only existing "
                "indices or GPU UUIDs (nvidia-smi -L).",
            )
        ]
    if any(e.isdigit() for e in entries) and order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
        return [
            Finding(
                "cuda.device_order",
                "warn",
                "CUDA_VISIBLE_DEVICES uses indices, GPUs differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                "index N is not nvidia-smi's GPU N",
                [f"CUDA_VISIBLE_DEVICES={cvd!r}", f"CUDA_DEVICE_ORDER={order}"],
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID (then CUDA and nvidia-smi number GPUs alike).",
            )
        ]
    return []


def _torch_device_order(s: SystemSnapshot, gpus: list[Gpu], order: str) -> list[Finding]:
    """torch's device order against NVML's PCI order, when torch tells us bus ids."""
    tdev = [d for d in s.torch.devices if d.get("bus_id")]
    if gpus and tdev:
        nvml_index = {g.bus_id: g.index for g in gpus}
        mapping = [(d["index"], nvml_index.get(normalise_bus_id(d["bus_id"]))) for d in tdev]
        pci_sorted = sorted(tdev, key=lambda d: normalise_bus_id(d["bus_id"]))
        if [d["index"] for d in pci_sorted] != [d["index"] for d in tdev] and order != "PCI_BUS_ID":
            return [
                Finding(
                    "cuda.device_order",
                    "warn",
                    "torch's cuda:N order differs from nvidia-smi's (PCI bus) order",
                    [f"cuda:{t} = nvidia-smi GPU{n}" for t, n in mapping],
                    "export CUDA_DEVICE_ORDER=PCI_BUS_ID so that cuda:N, nvidia-smi and sddoctor tui agree.",
                )
            ]
    return []


def _torch_gpu_count(s: SystemSnapshot, gpus: list[Gpu], cvd: str | None) -> list[Finding]:
    """As many CUDA devices in torch as NVML lists (or CUDA_VISIBLE_DEVICES keeps)."""
    if gpus and s.torch.available and s.torch.cuda_available:
        expected = len(gpus)
        if cvd is not None:
            expected = len(_visible_entries(cvd))
        if len(s.torch.devices) != expected:
            return [
                Finding(
                    "torch.gpu_mismatch",
                    "warn",
                    f"torch sees {len(s.torch.devices)} GPU(s), NVML {len(gpus)}"
                    + (f" and CUDA_VISIBLE_DEVICES lists {expected}" if cvd is not None else ""),
                    [f"torch: {[d.get('name') for d in s.torch.devices]}", f"NVML: {[g.name for g in gpus]}"],
                    "A GPU that NVML lists but CUDA cannot open is often in a bad state (Xid errors in "
                    "dmesg, needs a reset) or in use in exclusive-process mode (nvidia-smi -q -d COMPUTE).",
                )
            ]
    return []


# -- topology, ACS, IOMMU -------------------------------------------------------------------------


def check_topology(s: SystemSnapshot) -> list[Finding]:
    topo = s.topology
    if not topo.available or len(topo.gpus) < 2:
        return []
    n = len(topo.gpus)
    cell = {(i, i): "X" for i in range(n)}
    groups: dict[str, list[str]] = {}
    for p in topo.pairs:
        gbps, why = expected_pair_gbps(topo, p)
        mark = p.label + ("" if p.p2p_ok or p.kind == "nvlink" else "*")
        cell[(p.a, p.b)] = cell[(p.b, p.a)] = mark
        groups.setdefault(f"{mark}: expect ~{gbps or 0:.0f} GB/s ({why})", []).append(f"{p.a}-{p.b}")
    width = max(5, *(len(c) + 1 for c in cell.values()))
    rows = ["GPU".ljust(6) + "".join(f"GPU{j}".rjust(width) for j in range(n))]
    rows += [f"GPU{i}".ljust(6) + "".join(cell[(i, j)].rjust(width) for j in range(n)) for i in range(n)]
    rows += [f"{text} [{len(pairs)} pair(s)]" for text, pairs in groups.items()]
    if any(c.endswith("*") for c in cell.values()):
        rows.append("* = no P2P between the pair")
    busbw, why = expected_busbw_gbps(topo)
    findings = [
        Finding(
            "topo.matrix",
            "info",
            f"GPU links (nvidia-smi topo -m labels); an all-reduce over all GPUs should reach about "
            f"{busbw or 0:.0f} GB/s busbw",
            [*rows, f"slowest pair: {why}"],
            "Labels: NV# = # NVLinks, NVSwitch, PIX = one PCIe switch, PXB = several switches, "
            "PHB = through the CPU host bridge, NODE = across host bridges, SYS = across CPU sockets.",
        )
    ]
    no_p2p = [p for p in topo.pairs if p.kind == "pcie" and not p.p2p_ok]
    if no_p2p:
        findings.append(
            Finding(
                "topo.p2p_unsupported",
                "info",
                f"{len(no_p2p)} GPU pair(s) have no PCIe P2P: NCCL copies through host memory (SHM), "
                "about half the PCIe bandwidth",
                [
                    f"GPU{p.a}-GPU{p.b} via {p.ancestor}: read {p.p2p_read}, write {p.p2p_write}"
                    for p in no_p2p
                ],
                "Expected on consumer GPUs and across CPU sockets; keep the job's GPUs under one PCIe "
                "switch or CPU (CUDA_VISIBLE_DEVICES) for the best bandwidth.",
            )
        )
    counts: dict[str, list[tuple[int, int]]] = {}
    for g in topo.gpus:
        counts.setdefault(g.name, []).append((g.index, len(g.nvlinks)))
    for name, items in counts.items():
        most = max(n for _, n in items)
        low = [(i, n) for i, n in items if n < most]
        if most and low:
            findings.append(
                Finding(
                    "topo.nvlink_down",
                    "warn",
                    f"some {name} GPUs have fewer active NVLinks than their siblings",
                    [f"GPU{i}: {n} of {most} links active" for i, n in low],
                    "`nvidia-smi nvlink -s` shows each link; inactive links usually need a GPU reset or "
                    "a fabric-manager restart (systemctl status nvidia-fabricmanager on NVSwitch boxes).",
                )
            )
    geforce = [g for g in topo.gpus if "4090" in g.name or "5090" in g.name]
    pcie_p2p = [p for p in topo.pairs if p.kind == "pcie" and p.p2p_ok]
    if geforce and pcie_p2p:
        findings.append(
            Finding(
                "p2p.geforce",
                "warn",
                "the driver reports PCIe P2P between GeForce RTX 4090/5090 cards, which are known to "
                "hang or return wrong results with it (NVIDIA/nccl-tests issue 117)",
                [f"GPU{p.a}-GPU{p.b} P2P read/write ok via {p.ancestor}" for p in pcie_p2p[:8]],
                "Update the driver (newer drivers report no P2P on these cards), or set NCCL_P2P_DISABLE=1; "
                "the collective test below checks the results.",
            )
        )
    return findings


def _pcie_p2p_pairs(s: SystemSnapshot) -> list[tuple[int, int]]:
    topo = s.topology
    if not topo.available:
        return []
    return [(p.a, p.b) for p in topo.pairs if p.kind == "pcie" and p.p2p_ok]


def _bridges_between(s: SystemSnapshot, a_bus: str, b_bus: str) -> list[str]:
    """The bridges that P2P traffic between two GPUs passes: those not common to both paths,
    plus the lowest common one (the switch that should route it)."""
    da, db = s.pci.devices.get(a_bus), s.pci.devices.get(b_bus)
    if da is None or db is None:
        return []
    common = [x for x, y in zip(da.upstream, db.upstream, strict=False) if x == y]
    rest = [x for x in da.upstream + db.upstream if x not in common]
    return (common[-1:] if common else []) + rest


def check_acs_iommu(s: SystemSnapshot) -> list[Finding]:
    pairs = _pcie_p2p_pairs(s)
    findings: list[Finding] = []
    if not pairs:
        return findings
    gpus = s.topology.gpus
    offenders: dict[str, list[str]] = {}
    unknown: set[str] = set()
    for a, b in pairs:
        for bridge in _bridges_between(s, gpus[a].bus_id, gpus[b].bus_id):
            dev = s.pci.devices.get(bridge)
            if dev is None or dev.acs_redirects_p2p is None:
                unknown.add(bridge)
            elif dev.acs_redirects_p2p:
                bits = [k for k in ACS_P2P_REDIRECT_BITS if dev.acs_ctl and dev.acs_ctl.get(k)]
                offenders.setdefault(bridge, [f"ACSCtl {' '.join(b + '+' for b in bits)} ({dev.acs_source})"])
    if offenders:
        findings.append(
            Finding(
                "pcie.acs_enabled",
                "fail",
                "ACS redirects peer-to-peer traffic on PCIe bridges between GPUs that use P2P: "
                f"the classic NCCL hang or crawl ({P2P_ISSUES})",
                [f"bridge {b}: {v[0]}" for b, v in offenders.items()],
                "Disable ACS on those bridges (BIOS: 'ACS' / 'PCIe ACS control' off, or per boot: "
                "`sudo setpci -s <bridge> ECAP_ACS+6.w=0000`), or as a workaround "
                "NCCL_P2P_DISABLE=1, which costs roughly half the PCIe bandwidth.",
            )
        )
    elif unknown and s.pci.available:
        findings.append(
            Finding(
                "pcie.acs_unknown",
                "info",
                "ACS state of the PCIe bridges between P2P GPUs cannot be read (needs root)",
                [f"bridges: {', '.join(sorted(unknown)[:8])}"],
                "Check by hand: `sudo lspci -vvv | grep -i ACSCtl`: ReqRedir+ or CmpltRedir+ on a bridge "
                f"between GPUs means P2P goes through the CPU or hangs ({P2P_ISSUES}).",
            )
        )
    iommu = s.pci.iommu
    if iommu.mode == "translated":
        findings.append(
            Finding(
                "iommu.translated",
                "warn",
                "the IOMMU translates DMA for the GPUs: PCIe P2P may hang or be slow",
                [f"{iommu.groups} IOMMU groups", f"kernel flags: {' '.join(iommu.cmdline_flags) or '-'}"],
                "Boot with iommu=pt (keeps the IOMMU but passes device DMA through) or disable VT-d/AMD-Vi "
                f"in the BIOS; workaround NCCL_P2P_DISABLE=1 ({P2P_ISSUES}).",
            )
        )
    return findings


# -- host resources -------------------------------------------------------------------------------


def check_shm(s: SystemSnapshot) -> list[Finding]:
    if s.shm_total is None:
        return [
            Finding(
                "shm.size",
                "warn",
                "/dev/shm is missing: NCCL's shared-memory transport cannot work",
                [],
                "Mount a tmpfs at /dev/shm (Docker: --ipc=host or --shm-size=16g).",
            )
        ]
    size = s.shm_total / MIB
    evidence = [f"/dev/shm {size:.0f} MiB, {(s.shm_free or 0) / MIB:.0f} MiB free"]
    fix = (
        "Docker: run with --ipc=host or --shm-size=16g; Kubernetes: mount an emptyDir with "
        "medium: Memory at /dev/shm."
        if s.in_container
        else "Remount bigger: sudo mount -o remount,size=16G /dev/shm."
    )
    gpus = _gpu_count(s)
    if s.shm_total < SHM_FAIL_BELOW and gpus >= 2:
        return [
            Finding(
                "shm.size",
                "fail",
                f"/dev/shm is only {size:.0f} MiB: NCCL fails with 'unhandled system error' or a bus "
                "error when its SHM transport maps its buffers (Docker's default is 64 MB)",
                evidence,
                fix,
            )
        ]
    if s.shm_total < SHM_WARN_BELOW:
        sev = "warn" if gpus >= 2 else "info"
        return [
            Finding(
                "shm.size",
                sev,
                f"/dev/shm is {size:.0f} MiB: tight for NCCL and DataLoader workers",
                evidence,
                fix,
            )
        ]
    return [Finding("shm.size", "ok", f"/dev/shm is {size / 1024:.1f} GiB", evidence)]


def _fmt_limit(v: int) -> str:
    return "unlimited" if v < 0 else str(v)


def check_limits(s: SystemSnapshot) -> list[Finding]:
    findings: list[Finding] = []
    rdma = any(d.active for d in s.rdma)
    if s.memlock is not None:
        soft, hard = s.memlock
        ev = [f"memlock soft {_fmt_limit(soft)}, hard {_fmt_limit(hard)} bytes"]
        if soft >= 0 and rdma:
            findings.append(
                Finding(
                    "limits.memlock",
                    "fail" if soft < 64 * MIB else "warn",
                    "locked-memory limit is not unlimited on a machine with active InfiniBand/RoCE: "
                    "NCCL cannot register its buffers",
                    ev,
                    "ulimit -l unlimited (limits.conf: '* - memlock unlimited'); Docker: "
                    "--ulimit memlock=-1:-1.",
                )
            )
        else:
            findings.append(
                Finding("limits.memlock", "ok", "locked-memory limit is fine for this network", ev)
            )
    if s.nofile is not None:
        soft, hard = s.nofile
        ev = [f"nofile soft {_fmt_limit(soft)}, hard {_fmt_limit(hard)}"]
        big = _gpu_count(s) >= 4 or s.nnodes > 1
        if 0 <= soft < NOFILE_WARN_BELOW and big:
            findings.append(
                Finding(
                    "limits.nofile",
                    "warn",
                    f"open-file limit {soft} is low for NCCL (sockets, shared memory and CUDA IPC handles "
                    "per peer) and DataLoader workers",
                    ev,
                    f"ulimit -n {hard if hard > 0 else 65536} (or raise the hard limit in limits.conf; "
                    "Docker: --ulimit nofile=65536:65536).",
                )
            )
        else:
            findings.append(Finding("limits.nofile", "ok", f"open-file limit {_fmt_limit(soft)}", ev))
    return findings


# -- NCCL environment -----------------------------------------------------------------------------


def _ifname_matches(spec: str, name: str) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma list of prefixes; '^' excludes; '=' means exact names."""
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.lstrip("^")
    exact = text.startswith("=")
    text = text.lstrip("=")
    names = [p.strip() for p in text.split(",") if p.strip()]
    hit = any(name == p if exact else name.startswith(p) for p in names)
    return not hit if exclude else hit


def nccl_socket_candidates(
    interfaces: list[NetInterface], env: dict[str, str]
) -> tuple[list[NetInterface], str]:
    """The interfaces NCCL's socket/bootstrap code would use, in order, and the rule that chose them."""
    family = env.get("NCCL_SOCKET_FAMILY", "").upper()

    def has_addr(i: NetInterface) -> bool:
        if family == "AF_INET6":
            return bool([a for a in i.ipv6 if not a.lower().startswith("fe80")])
        if family == "AF_INET":
            return bool(i.ipv4)
        return bool(i.ipv4 or [a for a in i.ipv6 if not a.lower().startswith("fe80")])

    usable = [i for i in interfaces if has_addr(i) and i.up]  # NCCL skips interfaces not RUNNING
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec:
        return [i for i in usable if _ifname_matches(spec, i.name)], f"NCCL_SOCKET_IFNAME={spec}"
    for rule, pick in (
        ("ib* interfaces first", lambda i: i.name.startswith("ib")),
        # NCCL < 2.28 did not exclude virbr* here; br-*, veth*, cni* are used either way.
        ("any interface but docker*/lo/virbr*", lambda i: not i.name.startswith(("docker", "lo", "virbr"))),
        ("docker* as a last resort", lambda i: i.name.startswith("docker")),
        ("lo as a last resort", lambda i: i.name.startswith("lo")),
        ("virbr* as the very last resort", lambda i: i.name.startswith("virbr")),
    ):
        chosen = [i for i in usable if pick(i)]
        if chosen:
            return chosen, f"NCCL's default order: {rule}"
    return [], "no interface with an address"


def check_nccl_env(s: SystemSnapshot) -> list[Finding]:
    findings = _nccl_var_names(s.env)
    findings += _nccl_transport_settings(s)
    findings += _nccl_network_settings(s)
    return findings


def _nccl_var_names(env: dict[str, str]) -> list[Finding]:
    """NCCL_* names that NCCL does not read: renamed by torch, removed, misspelled or unknown."""
    findings: list[Finding] = []
    for name in sorted(k for k in env if k.startswith("NCCL_")):
        if name in KNOWN_NCCL_VARS or name in NOT_SETTINGS:
            continue
        if name in TORCH_RENAMED_VARS:
            findings.append(
                Finding(
                    "nccl.env.torch_renamed",
                    "info",
                    f"{name} is the old PyTorch name; torch 2.2+ reads {TORCH_RENAMED_VARS[name]}",
                    [f"{name}={env[name]}"],
                    f"Rename it to {TORCH_RENAMED_VARS[name]} (the old name still works on some versions "
                    "with a deprecation warning).",
                )
            )
        elif name in REMOVED_NCCL_VARS:
            findings.append(
                Finding(
                    "nccl.env.removed",
                    "info",
                    f"{name} no longer has any effect: {REMOVED_NCCL_VARS[name]}",
                    [f"{name}={env[name]}"],
                    f"Remove {name}.",
                )
            )
        elif (guess := closest_nccl_var(name)) is not None:
            findings.append(
                Finding(
                    "nccl.env.misspelled",
                    "warn",
                    f"{name} is not an NCCL variable (NCCL ignores it silently); did you mean {guess}?",
                    [f"{name}={env[name]}"],
                    f"Rename it: export {guess}={env[name]}; unset {name}.",
                )
            )
        else:
            findings.append(
                Finding(
                    "nccl.env.unknown",
                    "info",
                    f"{name} is not a variable this NCCL list knows; NCCL ignores unknown names",
                    [f"{name}={env[name]}"],
                    "Check the spelling against https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html.",
                )
            )
    return findings


def _nccl_transport_settings(s: SystemSnapshot) -> list[Finding]:
    """P2P and SHM switched off between the GPUs of this node."""
    env = s.env
    findings: list[Finding] = []
    topo = s.topology
    nvlink = topo.available and any(p.kind == "nvlink" for p in topo.pairs)
    if _truthy(env.get("NCCL_P2P_DISABLE")) and _gpu_count(s) >= 2:
        findings.append(
            Finding(
                "nccl.env.p2p_disabled",
                "warn" if nvlink else "info",
                "NCCL_P2P_DISABLE=1 on a machine with NVLink: intra-node traffic falls back to host memory, "
                "often 10x slower"
                if nvlink
                else "NCCL_P2P_DISABLE=1: GPU-to-GPU traffic goes through host memory (about half the PCIe "
                "bandwidth); fine as a workaround for broken P2P",
                [f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']}"],
                "Unset NCCL_P2P_DISABLE unless P2P hangs here (see pcie.acs_enabled / iommu.translated).",
            )
        )
    if _truthy(env.get("NCCL_SHM_DISABLE")) and _truthy(env.get("NCCL_P2P_DISABLE")) and _gpu_count(s) >= 2:
        findings.append(
            Finding(
                "nccl.env.shm_disabled",
                "warn",
                "both NCCL_P2P_DISABLE and NCCL_SHM_DISABLE are set: GPUs on this node talk over the network "
                "stack (sockets), the slowest path",
                [f"NCCL_SHM_DISABLE={env['NCCL_SHM_DISABLE']}"],
                "Unset NCCL_SHM_DISABLE (enlarge /dev/shm instead if SHM failed).",
            )
        )
    return findings


def _nccl_network_settings(s: SystemSnapshot) -> list[Finding]:
    """NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE and NCCL_IB_HCA against this machine's interfaces and
    RDMA devices."""
    env = s.env
    findings: list[Finding] = []
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec is not None:
        chosen, _ = nccl_socket_candidates(s.interfaces, env)
        if not chosen:
            listed = ", ".join(f"{i.name}({','.join(i.ipv4) or 'no IPv4'})" for i in s.interfaces)
            findings.append(
                Finding(
                    "nccl.env.ifname_missing",
                    "fail",
                    f"NCCL_SOCKET_IFNAME={spec} matches no interface with an address: NCCL init fails "
                    "with 'no socket interface found'",
                    [f"interfaces here: {listed}"],
                    "Set NCCL_SOCKET_IFNAME to an interface listed above (prefix match; '=' for exact, "
                    "'^' to exclude), or unset it.",
                )
            )
    ib_active = [d for d in s.rdma if d.active]
    if _truthy(env.get("NCCL_IB_DISABLE")) and ib_active:
        findings.append(
            Finding(
                "nccl.env.ib_disabled",
                "warn",
                "NCCL_IB_DISABLE=1 although InfiniBand/RoCE devices are active: inter-node traffic goes over "
                "TCP sockets",
                [
                    f"{d.name}: {', '.join(p['state'] + ' ' + p['link_layer'] + ' ' + p['rate'] for p in d.ports)}"
                    for d in ib_active
                ],
                "Unset NCCL_IB_DISABLE (single-node jobs are unaffected either way).",
            )
        )
    hca = env.get("NCCL_IB_HCA")
    if hca and s.rdma is not None:
        wanted = [p.split(":")[0] for p in hca.lstrip("^=").split(",") if p.strip()]
        names = [d.name for d in s.rdma]
        if not hca.startswith("^") and not any(any(n.startswith(w) for n in names) for w in wanted):
            findings.append(
                Finding(
                    "nccl.env.ib_hca_missing",
                    "fail" if s.nnodes > 1 else "warn",
                    f"NCCL_IB_HCA={hca} names no RDMA device of this machine",
                    [f"RDMA devices here: {', '.join(names) or 'none'}"],
                    "Set NCCL_IB_HCA to devices from `ls /sys/class/infiniband` (or `ibv_devices`), or unset it.",
                )
            )
    return findings


# -- network and rendezvous -----------------------------------------------------------------------


def check_network(s: SystemSnapshot) -> list[Finding]:
    findings: list[Finding] = []
    chosen, rule = nccl_socket_candidates(s.interfaces, s.env)
    desc = [
        f"{i.name} ({i.kind}, {', '.join(i.ipv4 or i.ipv6)}{', down' if not i.up else ''})" for i in chosen
    ]
    multi = s.nnodes > 1 or (s.master.is_local is False)
    first = chosen[0] if chosen else None
    if first is not None and first.kind in ("virtual", "veth", "docker", "loopback") and multi:
        findings.append(
            Finding(
                "net.virtual_interface",
                "warn",
                f"for a multi-node job NCCL would use {first.name}, a {first.kind} interface other nodes "
                "cannot reach",
                [f"{rule}: {', '.join(desc)}"],
                "Set NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to the interface that carries the "
                "cluster network, e.g. NCCL_SOCKET_IFNAME=eth0.",
            )
        )
    elif chosen or not s.env.get("NCCL_SOCKET_IFNAME"):  # else nccl.env.ifname_missing says it
        findings.append(
            Finding(
                "net.interfaces",
                "info" if chosen else ("fail" if multi else "info"),
                f"NCCL's socket transport and bootstrap would use {first.name if first else 'no interface'}",
                [f"{rule}: {', '.join(desc) or '-'}"],
                "Pin it with NCCL_SOCKET_IFNAME=<name> if that is the wrong network.",
            )
        )
    loopback_master = bool(s.master.route_ip and s.master.route_ip.startswith(("127.", "::1")))
    if s.master.route_ip and first is not None and multi and not loopback_master:
        owner = next((i for i in s.interfaces if s.master.route_ip in i.ipv4 + i.ipv6), None)
        if owner is not None and owner.name != first.name and not s.env.get("NCCL_SOCKET_IFNAME"):
            findings.append(
                Finding(
                    "net.route_mismatch",
                    "warn",
                    f"MASTER_ADDR is reached through {owner.name} but NCCL would pick {first.name}",
                    [f"route to {s.master.addr}: source {s.master.route_ip} on {owner.name}"],
                    f"export NCCL_SOCKET_IFNAME={owner.name} GLOO_SOCKET_IFNAME={owner.name}",
                )
            )
    if s.rdma:
        active = [d for d in s.rdma if d.active]
        ev = [
            f"{d.name} ({', '.join(d.netdevs) or 'no netdev'}): "
            + "; ".join(f"port {p['port']} {p['state']} {p['link_layer']} {p['rate']}" for p in d.ports)
            for d in s.rdma
        ]
        findings.append(
            Finding(
                "net.rdma",
                "info" if active or not multi else "warn",
                f"{len(active)} of {len(s.rdma)} RDMA device(s) active (InfiniBand or RoCE)",
                ev,
                "Inactive ports: check cables and the subnet manager (ibstat); NCCL uses active ones "
                "unless NCCL_IB_DISABLE=1.",
            )
        )
    return findings


def check_master(s: SystemSnapshot) -> list[Finding]:
    m = s.master
    if not m.addr:
        if s.nnodes > 1:
            return [
                Finding(
                    "master.unset",
                    "fail",
                    "several nodes but no MASTER_ADDR: the nodes cannot find each other",
                    [f"nnodes={s.nnodes}"],
                    "Pass --master-addr <node 0's address> --master-port <port> (same on every node).",
                )
            ]
        return [
            Finding(
                "master.unset",
                "ok",
                "MASTER_ADDR not set: single-node runs use 127.0.0.1 (torchrun sets it itself)",
                [],
            )
        ]
    if m.resolve_error:
        return [
            Finding(
                "master.unresolvable",
                "fail",
                f"MASTER_ADDR={m.addr} does not resolve",
                [m.resolve_error],
                "Use node 0's IP address, or fix DNS / /etc/hosts on this node.",
            )
        ]
    ev = [f"{m.addr} -> {', '.join(m.resolved)}" + (" (this host)" if m.is_local else "")]
    if m.port is None:
        return [
            Finding(
                "master.port_unset",
                "warn" if s.nnodes > 1 else "info",
                "MASTER_ADDR is set but MASTER_PORT is not",
                ev,
                "export MASTER_PORT=29500 (any free port, the same on every node).",
            )
        ]
    ev.append(f"port {m.port}")
    if m.port_free is False:
        return [
            Finding(
                "master.port_in_use",
                "fail",
                f"MASTER_PORT {m.port} is already in use on this host: the rendezvous store cannot listen",
                [*ev, m.port_error or ""],
                "Pick another port (--master-port), or stop the job that holds it (ss -ltnp | grep :PORT).",
            )
        ]
    if m.reachable is False:
        # Before node 0 starts nothing listens there: a refusal is expected on other nodes then.
        refused = "refused" in (m.reach_error or "")
        return [
            Finding(
                "master.unreachable",
                "warn" if refused else "fail",
                f"{m.addr}:{m.port} cannot be reached: {m.reach_error}",
                ev,
                "Start node 0 first (refused = nothing listens yet); otherwise open the port in the "
                "firewall and check that MASTER_ADDR is node 0's address on the cluster network.",
            )
        ]
    status = "free" if m.port_free else "reachable" if m.reachable else "not tested"
    return [Finding("master.ok", "ok", f"MASTER_ADDR {m.addr}:{m.port} resolves; port {status}", ev)]


CHECKS: list[Check] = [
    check_gpus,
    check_torch,
    check_cuda_visible,
    check_topology,
    check_acs_iommu,
    check_shm,
    check_limits,
    check_nccl_env,
    check_network,
    check_master,
]


def run_checks(snapshot: SystemSnapshot, checks: list[Check] | None = None) -> list[Finding]:
    """Every check over one snapshot. A check that crashes becomes a finding, never a traceback."""
    findings: list[Finding] = []
    for check in checks or CHECKS:
        try:
            findings.extend(check(snapshot))
        except Exception as exc:
            findings.append(
                Finding(
                    f"internal.{check.__name__}",
                    "warn",
                    f"the check {check.__name__} failed: {type(exc).__name__}: {exc}",
                    [],
                    "Please report this with `sddoctor check-nccl --json` output.",
                )
            )
    return findings
