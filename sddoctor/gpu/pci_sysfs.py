"""PCIe facts from sysfs: link speed and width, the bridges above each GPU, their ACS control bits,
IOMMU groups and mode.

Everything is read below a root directory (default "/"), so tests build a fake tree in a temporary
folder. ACS lives in PCIe extended config space, which only root can read in full; without it we
try `lspci -vvv` (which has the same limit) and otherwise report the state as unknown, never guess.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")

#: ACS control register bits, in the order lspci prints them.
ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
#: The bits that send peer-to-peer traffic up to the root complex instead of across the switch.
ACS_P2P_REDIRECT_BITS = ("ReqRedir", "CmpltRedir", "EgressCtrl")
ACS_CAP_ID = 0x000D


@dataclass
class PciDevice:
    bus_id: str
    vendor: str | None = None
    pci_class: str | None = None
    link_speed: str | None = None  # "16.0 GT/s PCIe"
    link_speed_max: str | None = None
    link_width: int | None = None
    link_width_max: int | None = None
    iommu_group: str | None = None
    iommu_type: str | None = None  # "identity" (passthrough), "DMA", "DMA-FQ" (translated)
    acs_ctl: dict[str, bool] | None = None  # None: could not be read
    acs_source: str | None = None  # "config" | "lspci"
    upstream: list[str] = field(default_factory=list)  # bridges from the root port down

    @property
    def is_bridge(self) -> bool:
        return bool(self.pci_class and self.pci_class.startswith("0x0604"))

    @property
    def acs_redirects_p2p(self) -> bool | None:
        if self.acs_ctl is None:
            return None
        return any(self.acs_ctl.get(bit) for bit in ACS_P2P_REDIRECT_BITS)


@dataclass
class IommuState:
    groups: int = 0
    cmdline_flags: list[str] = field(default_factory=list)
    mode: str = "unknown"  # "off" | "passthrough" | "translated" | "unknown"


@dataclass
class PciSnapshot:
    available: bool  # sysfs readable at all
    devices: dict[str, PciDevice] = field(default_factory=dict)  # GPUs and their upstream bridges
    gpus: list[str] = field(default_factory=list)  # bus ids of NVIDIA GPUs
    iommu: IommuState = field(default_factory=IommuState)
    acs_readable: bool = False  # at least one bridge's ACS control could be read


def read_pci(root: str | os.PathLike[str] = "/", use_lspci: bool = True) -> PciSnapshot:
    """Read the NVIDIA GPUs, every bridge above them, and the IOMMU state. Never raises."""
    base = Path(root)
    devices_dir = base / "sys/bus/pci/devices"
    snap = PciSnapshot(available=devices_dir.is_dir())
    snap.iommu = _read_iommu(base)
    if not snap.available:
        return snap
    # lspci reads the same config file, so it only helps where sysfs hides it from root (some
    # containers); as another user it cannot read ACS either and would only cost time.
    lspci = shutil.which("lspci") if use_lspci and hasattr(os, "geteuid") and os.geteuid() == 0 else None
    for entry in sorted(devices_dir.iterdir()):
        if not _BDF.match(entry.name):
            continue
        cls = _read(entry / "class") or ""
        if _read(entry / "vendor") != NVIDIA_VENDOR or not cls.startswith("0x03"):
            continue
        gpu = _read_device(entry, lspci)
        gpu.upstream = _upstream_bridges(entry)
        snap.devices[gpu.bus_id] = gpu
        snap.gpus.append(gpu.bus_id)
        for bridge_id in gpu.upstream:
            if bridge_id not in snap.devices and (devices_dir / bridge_id).exists():
                snap.devices[bridge_id] = _read_device(devices_dir / bridge_id, lspci)
    snap.acs_readable = any(d.acs_ctl is not None for d in snap.devices.values() if d.is_bridge)
    if snap.iommu.mode == "unknown" and snap.iommu.groups:
        types = {d.iommu_type for d in snap.devices.values() if d.bus_id in snap.gpus and d.iommu_type}
        if types == {"identity"}:
            snap.iommu.mode = "passthrough"
        elif types:
            snap.iommu.mode = "translated"
        elif any(
            f in ("intel_iommu=on", "amd_iommu=on", "amd_iommu=force") for f in snap.iommu.cmdline_flags
        ):
            snap.iommu.mode = "translated"  # kernels before 5.11 have no group type file
    return snap


def parse_acs_config(config: bytes) -> dict[str, bool] | None:
    """ACS control bits from a device's config space bytes; None when there is no ACS capability
    or the extended space (bytes 256+) is not there (non-root reads get only the first 64 bytes)."""
    if len(config) < 0x108:
        return None
    offset, seen = 0x100, set()
    while offset and offset not in seen and offset + 8 <= len(config):
        seen.add(offset)
        header = int.from_bytes(config[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            ctl = int.from_bytes(config[offset + 6 : offset + 8], "little")
            return {name: bool(ctl & (1 << bit)) for bit, name in enumerate(ACS_BITS)}
        offset = (header >> 20) & 0xFFC
    return None


def parse_lspci_acsctl(text: str) -> dict[str, bool] | None:
    """ACS control bits from `lspci -vvv` output ("ACSCtl: SrcValid+ TransBlk- ReqRedir+ ...")."""
    match = re.search(r"ACSCtl:\s*(.+)", text)
    if not match:
        return None
    bits = dict(re.findall(r"(\w+)([+-])", match.group(1)))
    if not bits:
        return None
    return {name: bits.get(name) == "+" for name in ACS_BITS}


def link_gen(speed: str | None) -> int | None:
    """PCIe generation from sysfs' link speed text ("16.0 GT/s PCIe" -> 4)."""
    if not speed:
        return None
    match = re.match(r"\s*([\d.]+)\s*GT/s", speed)
    if not match:
        return None
    gts = float(match.group(1))
    for gen, rate in ((6, 64.0), (5, 32.0), (4, 16.0), (3, 8.0), (2, 5.0), (1, 2.5)):
        if gts >= rate * 0.99:
            return gen
    return None


def _read_device(path: Path, lspci: str | None) -> PciDevice:
    dev = PciDevice(
        bus_id=path.name,
        vendor=_read(path / "vendor"),
        pci_class=_read(path / "class"),
        link_speed=_read(path / "current_link_speed"),
        link_speed_max=_read(path / "max_link_speed"),
        link_width=_int(_read(path / "current_link_width")),
        link_width_max=_int(_read(path / "max_link_width")),
    )
    group = path / "iommu_group"
    if group.exists():
        dev.iommu_group = os.path.basename(os.path.realpath(group))
        dev.iommu_type = _read(group / "type")
    try:
        dev.acs_ctl = parse_acs_config((path / "config").read_bytes())
        dev.acs_source = "config" if dev.acs_ctl is not None else None
    except OSError:
        pass
    if dev.acs_ctl is None and lspci and dev.is_bridge:
        try:
            out = subprocess.run(
                [lspci, "-vvv", "-s", dev.bus_id], capture_output=True, text=True, timeout=3
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        dev.acs_ctl = parse_lspci_acsctl(out)
        dev.acs_source = "lspci" if dev.acs_ctl is not None else None
    return dev


def _upstream_bridges(path: Path) -> list[str]:
    """Bus ids of the bridges above a device, root port first, taken from its resolved sysfs path
    (/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0 -> [00:01.0, 01:00.0])."""
    parts = Path(os.path.realpath(path)).parts
    chain = [p for p in parts if _BDF.match(p)]
    return chain[:-1]


def _read_iommu(base: Path) -> IommuState:
    state = IommuState()
    groups = base / "sys/kernel/iommu_groups"
    try:
        state.groups = sum(1 for _ in groups.iterdir()) if groups.is_dir() else 0
    except OSError:
        state.groups = 0
    cmdline = _read(base / "proc/cmdline") or ""
    state.cmdline_flags = [
        tok for tok in cmdline.split() if tok.split("=")[0] in ("iommu", "intel_iommu", "amd_iommu")
    ]
    flags = dict(tok.split("=", 1) for tok in state.cmdline_flags if "=" in tok)
    if flags.get("iommu") == "pt":
        state.mode = "passthrough"
    elif flags.get("iommu") == "off" or (state.groups == 0 and groups.parent.is_dir()):
        state.mode = "off"
    return state


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
