"""Fake systems for the check-nccl tests: snapshots built by hand, a fake pynvml, a fake sysfs tree."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sddoctor.gpu.pci_sysfs import IommuState, PciDevice, PciSnapshot
from sddoctor.gpu.topology import Gpu, NvLink, PairLink, Topology
from sddoctor.preflight.snapshot import MasterInfo, NetInterface, RdmaDevice, SystemSnapshot, TorchInfo

GIB = 1024**3


def torch_ok(n: int, name: str = "NVIDIA H100 80GB HBM3", buses: list[str] | None = None) -> TorchInfo:
    buses = buses or [f"0000:{0x18 + i:02x}:00.0" for i in range(n)]
    return TorchInfo(
        available=True,
        version="2.11.0+cu128",
        cuda_version="12.8",
        nccl_version="2.27.5",
        nccl_available=True,
        gloo_available=True,
        cuda_available=n > 0,
        devices=[{"index": i, "name": name, "bus_id": buses[i], "memory": 80 * GIB} for i in range(n)],
    )


def nvswitch_box(n: int = 8, name: str = "NVIDIA H100 80GB HBM3", links: int = 18) -> Topology:
    gpus = []
    for i in range(n):
        gpus.append(
            Gpu(
                index=i,
                name=name,
                uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
                bus_id=f"0000:{0x18 + i:02x}:00.0",
                memory_total=80 * GIB,
                pcie_gen=5,
                pcie_gen_max=5,
                pcie_width=16,
                pcie_width_max=16,
                nvlinks=[
                    NvLink(link=k, version=4, remote_bus_id="0000:ff:00.0", remote_kind="switch")
                    for k in range(links)
                ],
            )
        )
    pairs = [
        PairLink(a, b, "SYS" if (a < n // 2) != (b < n // 2) else "NODE", 0, True, "ok", "ok", "ok")
        for a in range(n)
        for b in range(a + 1, n)
    ]
    return Topology(True, None, "570.86.15", "12.8", "12.570", gpus, pairs)


def pcie_box(
    n: int = 4, name: str = "NVIDIA GeForce RTX 4090", p2p: bool = False, ancestor: str = "PXB"
) -> Topology:
    gpus = [
        Gpu(
            i,
            name,
            f"GPU-{i:08d}-1111-1111-1111-111111111111",
            f"0000:{0x41 + i:02x}:00.0",
            24 * GIB,
            1,
            4,
            16,
            16,
        )
        for i in range(n)
    ]
    status = "ok" if p2p else "chipset not supported"
    pairs = [
        PairLink(a, b, ancestor, 0, False, status, status, "not supported")
        for a in range(n)
        for b in range(a + 1, n)
    ]
    return Topology(True, None, "550.54.14", "12.4", "12.550", gpus, pairs)


def eth(name: str = "eth0", ip: str = "10.0.0.5", physical: bool = True) -> NetInterface:
    return NetInterface(name=name, ipv4=[ip], up=True, speed_mbps=25000, mtu=1500, physical=physical)


def snapshot(**overrides: Any) -> SystemSnapshot:
    """A healthy 8-GPU NVSwitch box, single node; override any field."""
    base = SystemSnapshot(
        host="node0",
        platform="Linux",
        topology=nvswitch_box(),
        pci=PciSnapshot(available=True, iommu=IommuState(groups=0, mode="off")),
        torch=torch_ok(8),
        env={},
        shm_total=64 * GIB,
        shm_free=64 * GIB,
        memlock=(-1, -1),
        nofile=(1048576, 1048576),
        interfaces=[NetInterface("lo", ["127.0.0.1"], up=True), eth()],
        rdma=[],
        master=MasterInfo(),
    )
    for key, value in overrides.items():
        setattr(base, key, value)
    return base


def acs_pci(bits_on: bool, readable: bool = True) -> PciSnapshot:
    """4 GPUs under one PCIe switch (root port 0000:30:01.0 -> switch 0000:31:00.0 -> ports)."""
    devices: dict[str, PciDevice] = {}
    root, up = "0000:30:01.0", "0000:31:00.0"
    acs = {"SrcValid": True, "ReqRedir": bits_on, "CmpltRedir": bits_on} if readable else None
    for dev_id in (root, up):
        devices[dev_id] = PciDevice(
            dev_id, "0x8086", "0x060400", acs_ctl=acs, acs_source="config" if readable else None
        )
    gpus = []
    for i in range(4):
        port = f"0000:32:{i:02x}.0"
        devices[port] = PciDevice(
            port, "0x1000", "0x060400", acs_ctl=acs, acs_source="config" if readable else None
        )
        bus = f"0000:{0x41 + i:02x}:00.0"
        devices[bus] = PciDevice(bus, "0x10de", "0x030000", upstream=[root, up, port])
        gpus.append(bus)
    return PciSnapshot(
        available=True,
        devices=devices,
        gpus=gpus,
        iommu=IommuState(groups=0, mode="off"),
        acs_readable=readable,
    )


def ib_device(active: bool = True) -> RdmaDevice:
    state = "4: ACTIVE" if active else "1: DOWN"
    return RdmaDevice(
        "mlx5_0", [{"port": "1", "state": state, "link_layer": "InfiniBand", "rate": "400 Gb/sec"}], ["ib0"]
    )


# -- fake pynvml -----------------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


class _Pci:
    def __init__(self, bus: str) -> None:
        self.busId = bus.encode()


class _Mem:
    total = 80 * GIB


class FakeNvml:
    """Enough of pynvml for `read_topology`: GPUs (name, bus), NVLinks per GPU, P2P and ancestors."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus: list[dict[str, Any]], ancestor: int = 20, p2p: int = 0) -> None:
        self.gpus = gpus
        self.ancestor = ancestor
        self.p2p = p2p

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.86.15"

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12.570.86.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12080

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> _Pci:
        return _Pci(self.gpus[h]["bus"])

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.gpus[h]["name"].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Mem:
        return _Mem()

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self.gpus[h].get("gen", 4)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self.gpus[h].get("width", 16)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        links = self.gpus[h].get("links", [])
        if link >= len(links):
            raise FakeNVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return 4

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> _Pci:
        return _Pci(self.gpus[h]["links"][link])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        remote = self.gpus[h]["links"][link]
        return 0 if any(g["bus"] == remote for g in self.gpus) else 2

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.ancestor

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        if index == 2 and not self.gpus[a].get("links"):
            return 5
        return self.p2p


# -- fake sysfs ------------------------------------------------------------------------------------


def write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text + "\n")


def acs_config(ctl: int) -> bytes:
    """4 KiB config space with an AER capability at 0x100 chained to ACS at 0x148."""
    data = bytearray(4096)
    data[0x100:0x104] = (0x0001 | (1 << 16) | (0x148 << 20)).to_bytes(4, "little")
    data[0x148:0x14C] = (0x000D | (1 << 16) | (0 << 20)).to_bytes(4, "little")
    data[0x14C:0x14E] = (0x7F).to_bytes(2, "little")
    data[0x14E:0x150] = ctl.to_bytes(2, "little")
    return bytes(data)


def fake_sysfs(root: Path, acs_ctl: int | None, iommu_type: str | None, cmdline: str = "quiet") -> Path:
    """Two GPUs behind one PCIe switch: root port 00:01.0 -> 01:00.0 -> ports 02:00.0 / 02:01.0."""
    devices = root / "sys/devices/pci0000:00"
    chain = {
        "0000:00:01.0": devices / "0000:00:01.0",
        "0000:01:00.0": devices / "0000:00:01.0/0000:01:00.0",
        "0000:02:00.0": devices / "0000:00:01.0/0000:01:00.0/0000:02:00.0",
        "0000:02:01.0": devices / "0000:00:01.0/0000:01:00.0/0000:02:01.0",
        "0000:03:00.0": devices / "0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
        "0000:04:00.0": devices / "0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0",
    }
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    groups = root / "sys/kernel/iommu_groups"
    groups.mkdir(parents=True)
    for n, (bdf, path) in enumerate(chain.items()):
        gpu = bdf in ("0000:03:00.0", "0000:04:00.0")
        write(path / "vendor", "0x10de" if gpu else "0x10b5")
        write(path / "class", "0x030200" if gpu else "0x060400")
        write(path / "current_link_speed", "16.0 GT/s PCIe" if gpu else "16.0 GT/s PCIe")
        write(path / "max_link_speed", "16.0 GT/s PCIe")
        write(path / "current_link_width", "8" if bdf == "0000:04:00.0" else "16")
        write(path / "max_link_width", "16")
        if acs_ctl is not None and not gpu:
            write(path / "config", acs_config(acs_ctl))
        else:
            write(path / "config", bytes(64))
        if iommu_type is not None:
            group = groups / str(n)
            write(group / "type", iommu_type)
            os.symlink(group, path / "iommu_group")
        os.symlink(path, bus / bdf)
    write(root / "proc/cmdline", cmdline)
    return root
