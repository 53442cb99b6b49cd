"""GPU topology as NVML sees it: devices, NVLinks, P2P status and the PCIe path between every pair.

`read_topology()` is the one function that talks to NVML (through `sddoctor.gpu.nvml`); the rest
are plain dataclasses and arithmetic, so checks and tests work on a `Topology` built by hand.
The link labels follow `nvidia-smi topo -m`: NV<n> (n NVLinks), PIX (one PCIe switch), PXB
(several switches), PHB (through a CPU host bridge), NODE (across host bridges in one NUMA node),
SYS (across the CPU socket interconnect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sddoctor.gpu.nvml import NvmlUnavailable, as_str, nvml

#: nvmlGpuTopologyLevel_t -> nvidia-smi's label
TOPOLOGY_LABELS: dict[int, str] = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

#: nvmlGpuP2PStatus_t -> words
P2P_STATUS: dict[int, str] = {
    0: "ok",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}

#: nvmlGpuP2PCapsIndex_t values (pynvml exports READ as a tuple by mistake, so spell them out)
P2P_READ, P2P_WRITE, P2P_NVLINK = 0, 1, 2

#: One NVLink's bandwidth per direction in GB/s, by NVLink version as NVML reports it.
NVLINK_GBPS_PER_LINK: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0, 6: 50.0}

#: One PCIe lane's usable bandwidth per direction in GB/s (after line encoding), by generation.
PCIE_GBPS_PER_LANE: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

#: Fraction of the raw link rate a well-behaved all-reduce reaches as busbw (nccl-tests on
#: 8xH100/H200 NVSwitch reach ~0.8-1.05 of 450 GB/s; PCIe x16 gen4 boxes reach ~25 of 31.5 GB/s).
NVLINK_EFFICIENCY = 0.8
PCIE_EFFICIENCY = 0.8
#: Without P2P, NCCL stages through host memory (SHM): roughly half the PCIe rate.
HOST_STAGED_EFFICIENCY = 0.4


@dataclass
class NvLink:
    link: int
    version: int | None
    remote_bus_id: str | None
    remote_kind: str  # "gpu" | "switch" | "cpu" | "unknown"


@dataclass
class Gpu:
    index: int  # NVML index (PCI bus order)
    name: str
    uuid: str
    bus_id: str  # normalised "0000:17:00.0"
    memory_total: int | None = None
    pcie_gen: int | None = None  # current (drops at idle to save power)
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlinks: list[NvLink] = field(default_factory=list)

    def pcie_gbps(self) -> float | None:
        """Raw per-direction PCIe bandwidth at the best generation and width the slot allows."""
        gen = self.pcie_gen_max or self.pcie_gen
        width = self.pcie_width_max or self.pcie_width
        if not gen or not width or gen not in PCIE_GBPS_PER_LANE:
            return None
        return PCIE_GBPS_PER_LANE[gen] * width

    def nvlink_gbps(self) -> float:
        return sum(NVLINK_GBPS_PER_LINK.get(link.version or 0, 25.0) for link in self.nvlinks)


@dataclass
class PairLink:
    """How GPUs a and b (NVML indices) talk to each other."""

    a: int
    b: int
    ancestor: str | None  # PIX/PXB/PHB/NODE/SYS/INT, None when NVML cannot say
    nvlinks: int  # direct NVLinks between the two
    via_nvswitch: bool
    p2p_read: str  # P2P_STATUS words
    p2p_write: str
    p2p_nvlink: str

    @property
    def label(self) -> str:
        """What `nvidia-smi topo -m` would print for this pair."""
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        if self.via_nvswitch:
            return "NVSwitch"
        return self.ancestor or "?"

    @property
    def p2p_ok(self) -> bool:
        return self.p2p_read == "ok" and self.p2p_write == "ok"

    @property
    def kind(self) -> str:
        if self.nvlinks or self.via_nvswitch:
            return "nvlink"
        return "pcie"


@dataclass
class Topology:
    available: bool
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.4": the newest CUDA the driver supports
    nvml_version: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    pairs: list[PairLink] = field(default_factory=list)

    def pair(self, a: int, b: int) -> PairLink | None:
        lo, hi = min(a, b), max(a, b)
        return next((p for p in self.pairs if p.a == lo and p.b == hi), None)


def expected_pair_gbps(topology: Topology, pair: PairLink) -> tuple[float | None, str]:
    """The bandwidth (GB/s per direction) a collective over this pair should reach, and why."""
    ga, gb = topology.gpus[pair.a], topology.gpus[pair.b]
    if pair.via_nvswitch or pair.nvlinks:
        if pair.via_nvswitch:
            raw = min(ga.nvlink_gbps(), gb.nvlink_gbps())
            how = f"NVSwitch, {len(ga.nvlinks)} links per GPU"
        else:
            per_link = NVLINK_GBPS_PER_LINK.get(ga.nvlinks[0].version or 0, 25.0) if ga.nvlinks else 25.0
            raw = per_link * pair.nvlinks
            how = f"{pair.nvlinks} NVLink(s)"
        return raw * NVLINK_EFFICIENCY, f"{how}, {raw:.0f} GB/s raw per direction"
    pcie = [g for g in (ga.pcie_gbps(), gb.pcie_gbps()) if g]
    if not pcie:
        return None, "PCIe generation/width unknown"
    raw = min(pcie)
    gen = min(g.pcie_gen_max or g.pcie_gen or 0 for g in (ga, gb))
    width = min(g.pcie_width_max or g.pcie_width or 0 for g in (ga, gb))
    link = f"PCIe gen{gen} x{width} ({raw:.1f} GB/s raw) via {pair.ancestor or '?'}"
    if pair.p2p_ok and pair.ancestor in ("PIX", "PXB", "INT"):
        return raw * PCIE_EFFICIENCY, link + ", P2P"
    if pair.p2p_ok:
        return raw * PCIE_EFFICIENCY * 0.75, link + ", P2P through the CPU"
    return raw * HOST_STAGED_EFFICIENCY, link + ", no P2P: staged through host memory"


def expected_busbw_gbps(topology: Topology) -> tuple[float | None, str]:
    """What an all-reduce over all GPUs should reach as busbw: the slowest pair bounds the ring."""
    best: tuple[float | None, str] = (None, "fewer than two GPUs")
    for pair in topology.pairs:
        gbps, why = expected_pair_gbps(topology, pair)
        if gbps is None:
            continue
        if best[0] is None or gbps < best[0]:
            best = (gbps, f"GPU{pair.a}-GPU{pair.b}: {why}")
    return best


def normalise_bus_id(bus_id: str) -> str:
    """NVML says "00000000:17:00.0", sysfs "0000:17:00.0", torch "0000:17:00.0": use sysfs' form."""
    text = bus_id.strip().lower()
    if text.count(":") == 2:
        domain, rest = text.split(":", 1)
        text = f"{int(domain, 16):04x}:{rest}"
    elif text.count(":") == 1:
        text = f"0000:{text}"
    return text


def count_gpus() -> int:
    """NVML's device count, 0 when NVML cannot be used. Cheap once NVML is loaded (read_topology
    loads it too), so a caller can size work by the GPU count before reading the whole topology."""
    try:
        return int(nvml().nvmlDeviceGetCount())
    except Exception:  # NvmlUnavailable, or an NVMLError from a driver that cannot list devices
        return 0


def read_topology() -> Topology:
    """Read devices, links and pairs from NVML. Never raises: an unusable NVML gives available=False."""
    try:
        lib = nvml()
    except NvmlUnavailable as exc:
        return Topology(available=False, error=str(exc))
    topo = Topology(available=True)
    topo.driver_version = _try(lambda: as_str(lib.nvmlSystemGetDriverVersion()))
    topo.nvml_version = _try(lambda: as_str(lib.nvmlSystemGetNVMLVersion()))
    cuda = _try(lib.nvmlSystemGetCudaDriverVersion)
    if isinstance(cuda, int) and cuda > 0:
        topo.cuda_driver_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
    try:
        count = int(lib.nvmlDeviceGetCount())
    except Exception as exc:  # NVMLError: the driver answered but cannot list devices
        return Topology(available=False, error=f"nvmlDeviceGetCount failed: {exc}")
    handles = []
    for index in range(count):
        handle = _try(lambda i=index: lib.nvmlDeviceGetHandleByIndex(i))
        if handle is None:
            continue
        handles.append(handle)
        topo.gpus.append(_read_gpu(lib, index, handle))
    max_links = int(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))
    for gpu, handle in zip(topo.gpus, handles, strict=True):
        gpu.nvlinks = _read_nvlinks(lib, handle, max_links)
    by_bus = {g.bus_id: g.index for g in topo.gpus}
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            topo.pairs.append(_read_pair(lib, topo.gpus[i], topo.gpus[j], handles[i], handles[j], by_bus))
    return topo


def _read_gpu(lib: Any, index: int, handle: Any) -> Gpu:
    pci = _try(lambda: lib.nvmlDeviceGetPciInfo(handle))
    bus = as_str(getattr(pci, "busId", "") or "") if pci is not None else ""
    mem = _try(lambda: lib.nvmlDeviceGetMemoryInfo(handle))
    return Gpu(
        index=index,
        name=as_str(_try(lambda: lib.nvmlDeviceGetName(handle)) or "?"),
        uuid=as_str(_try(lambda: lib.nvmlDeviceGetUUID(handle)) or "?"),
        bus_id=normalise_bus_id(bus) if bus else f"nvml-{index}",
        memory_total=getattr(mem, "total", None),
        pcie_gen=_try(lambda: lib.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
        pcie_gen_max=_try(lambda: lib.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        pcie_width=_try(lambda: lib.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        pcie_width_max=_try(lambda: lib.nvmlDeviceGetMaxPcieLinkWidth(handle)),
    )


def _read_nvlinks(lib: Any, handle: Any, max_links: int) -> list[NvLink]:
    links: list[NvLink] = []
    kinds = {0: "gpu", 1: "cpu", 2: "switch"}
    for link in range(max_links):
        try:
            state = lib.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:  # NOT_SUPPORTED / INVALID_ARGUMENT past the last link, or no NVLink at all
            continue
        if state != 1:  # NVML_FEATURE_ENABLED
            continue
        remote = _try(lambda lk=link: lib.nvmlDeviceGetNvLinkRemotePciInfo(handle, lk))
        remote_bus = as_str(getattr(remote, "busId", "") or "") if remote is not None else ""
        kind = _try(lambda lk=link: lib.nvmlDeviceGetNvLinkRemoteDeviceType(handle, lk))
        links.append(
            NvLink(
                link=link,
                version=_try(lambda lk=link: lib.nvmlDeviceGetNvLinkVersion(handle, lk)),
                remote_bus_id=normalise_bus_id(remote_bus) if remote_bus else None,
                remote_kind=kinds.get(kind, "unknown") if kind is not None else "unknown",
            )
        )
    return links


def _read_pair(lib: Any, ga: Gpu, gb: Gpu, ha: Any, hb: Any, by_bus: dict[str, int]) -> PairLink:
    level = _try(lambda: lib.nvmlDeviceGetTopologyCommonAncestor(ha, hb))

    def status(index: int) -> str:
        value = _try(lambda: lib.nvmlDeviceGetP2PStatus(ha, hb, index))
        return P2P_STATUS.get(value, "unknown") if value is not None else "unknown"

    direct = sum(1 for link in ga.nvlinks if link.remote_bus_id == gb.bus_id)
    # An NVLink whose far end is not a GPU of this box is a switch port (some drivers report the
    # NVSwitch as "unknown"): two GPUs both on switches share the fabric.
    a_switched = any(link.remote_kind == "switch" or link.remote_bus_id not in by_bus for link in ga.nvlinks)
    b_switched = any(link.remote_kind == "switch" or link.remote_bus_id not in by_bus for link in gb.nvlinks)
    return PairLink(
        a=ga.index,
        b=gb.index,
        ancestor=TOPOLOGY_LABELS.get(level) if level is not None else None,
        nvlinks=direct,
        via_nvswitch=not direct and a_switched and b_switched,
        p2p_read=status(P2P_READ),
        p2p_write=status(P2P_WRITE),
        p2p_nvlink=status(P2P_NVLINK),
    )


def _try(fn: Any) -> Any:
    """NVML calls fail with NOT_SUPPORTED on many boards; a missing reading is None, not an error."""
    try:
        return fn()
    except Exception:
        return None
