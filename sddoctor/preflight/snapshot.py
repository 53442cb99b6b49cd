"""`SystemSnapshot`: everything the checks look at, read once from the real system.

The checks are pure functions of a snapshot, so tests build one by hand (or from a fake sysfs tree
and a fake NVML) and the real readers stay thin. Readers never raise: a reading that cannot be
taken is None or carries the reason, and the checks say so.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import platform
import resource
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sddoctor.gpu.pci_sysfs import PciSnapshot, read_pci
from sddoctor.gpu.topology import Topology, normalise_bus_id, read_topology

#: The environment variables the checks read (plus every NCCL_* and TORCH_NCCL_* one).
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "GLOO_SOCKET_IFNAME",
)


@dataclass
class TorchInfo:
    available: bool
    error: str | None = None
    version: str | None = None
    cuda_version: str | None = None  # the CUDA torch was built with; None on CPU builds
    nccl_version: str | None = None
    nccl_available: bool = False
    gloo_available: bool = False
    cuda_available: bool = False
    cuda_error: str | None = None  # why torch.cuda.is_available() is False, when it says
    devices: list[dict[str, Any]] = field(default_factory=list)  # name, bus_id, uuid, memory
    source: str = "this process"  # or the collective test's local rank 0, which reads it instead
    unknown: bool = False  # nothing was read: the process that reads it ended first (error says how)


#: Where torch is read while a collective test runs: the parent never imports torch then.
TEST_WORKER_SOURCE = "the collective test's local rank 0"


def torch_info_from_dict(data: dict[str, Any], source: str) -> TorchInfo:
    """A TorchInfo sent as JSON by another process (keys this version does not know are dropped)."""
    known = {f for f in TorchInfo.__dataclass_fields__ if f not in ("source", "unknown")}
    return TorchInfo(**{k: v for k, v in data.items() if k in known}, source=source)


def torch_not_reported(reason: str) -> TorchInfo:
    return TorchInfo(available=False, error=reason, source=TEST_WORKER_SOURCE, unknown=True)


@dataclass
class NetInterface:
    name: str
    ipv4: list[str] = field(default_factory=list)
    ipv6: list[str] = field(default_factory=list)
    up: bool = False
    speed_mbps: int | None = None
    mtu: int | None = None
    physical: bool = False  # has /sys/class/net/NAME/device (a real NIC, not a bridge or veth)
    rdma_device: str | None = None  # the /sys/class/infiniband device behind it (IPoIB or RoCE)

    @property
    def kind(self) -> str:
        n = self.name
        if n == "lo" or n.startswith("lo"):
            return "loopback"
        if n.startswith("docker"):
            return "docker"
        if n.startswith(("br-", "virbr", "cni", "flannel", "cali", "weave", "vxlan", "tun", "tap")):
            return "virtual"
        if n.startswith("veth"):
            return "veth"
        if n.startswith("ib"):
            return "ipoib"
        return "ethernet" if self.physical else "other"


@dataclass
class RdmaDevice:
    name: str
    ports: list[dict[str, str]] = field(default_factory=list)  # port, state, link_layer, rate
    netdevs: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return any("ACTIVE" in p.get("state", "") for p in self.ports)


@dataclass
class MasterInfo:
    addr: str | None = None
    port: int | None = None
    resolved: list[str] = field(default_factory=list)
    resolve_error: str | None = None
    is_local: bool | None = None
    route_ip: str | None = None  # the local address the kernel would use to reach it
    reachable: bool | None = None  # TCP connect to addr:port succeeded
    reach_error: str | None = None
    port_free: bool | None = None  # only tested when the address is this host's
    port_error: str | None = None


@dataclass
class SystemSnapshot:
    host: str = ""
    platform: str = ""
    in_container: bool = False
    nnodes: int = 1
    node_rank: int = 0
    under_launcher: bool = False  # started by torchrun (its store already holds MASTER_PORT)
    topology: Topology = field(default_factory=lambda: Topology(available=False, error="not read"))
    pci: PciSnapshot = field(default_factory=lambda: PciSnapshot(available=False))
    torch: TorchInfo = field(default_factory=lambda: TorchInfo(available=False, error="not read"))
    env: dict[str, str] = field(default_factory=dict)
    shm_total: int | None = None  # bytes of /dev/shm
    shm_free: int | None = None
    memlock: tuple[int, int] | None = None  # soft, hard; -1 = unlimited
    nofile: tuple[int, int] | None = None
    interfaces: list[NetInterface] = field(default_factory=list)
    rdma: list[RdmaDevice] = field(default_factory=list)
    master: MasterInfo = field(default_factory=MasterInfo)


def collect_snapshot(
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    with_torch: bool = True,
    connect_timeout: float = 2.0,
    root: str = "/",
    master: MasterInfo | None = None,
) -> SystemSnapshot:
    """Read the real system. torch is imported here (not at module import) and only if asked.
    `master`: MASTER_ADDR already read by the caller (before the collective test took the port)."""
    env = read_env(os.environ)
    snap = SystemSnapshot(
        host=socket.gethostname(),
        platform=f"{platform.system()} {platform.release()} Python {platform.python_version()}",
        in_container=in_container(root),
        nnodes=nnodes,
        node_rank=node_rank,
        under_launcher=started_by_launcher(env),
        env=env,
    )
    snap.topology = read_topology()
    snap.pci = read_pci(root)
    if with_torch:
        snap.torch = read_torch()
    snap.shm_total, snap.shm_free = read_shm(os.path.join(root, "dev/shm"))
    snap.memlock = _rlimit(resource.RLIMIT_MEMLOCK)
    snap.nofile = _rlimit(resource.RLIMIT_NOFILE)
    snap.rdma = read_rdma(root)
    snap.interfaces = read_interfaces(root, snap.rdma)
    if master is None:
        addr, port = master_target(env, master_addr, master_port)
        master = read_master(addr, port, snap.under_launcher, connect_timeout, node_rank)
    snap.master = master
    return snap


def started_by_launcher(env: dict[str, str]) -> bool:
    """torchrun (or a launcher like it) started this process: its store already holds MASTER_PORT."""
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)


def master_target(
    env: dict[str, str], master_addr: str | None = None, master_port: int | None = None
) -> tuple[str | None, int | None]:
    """The rendezvous address and port: the options, else MASTER_ADDR / MASTER_PORT."""
    addr = master_addr or env.get("MASTER_ADDR")
    port_text = str(master_port) if master_port is not None else env.get("MASTER_PORT")
    return addr, (int(port_text) if port_text and port_text.isdigit() else None)


def read_env(environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in environ.items()
        if k in ENV_NAMES or k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED"))
    }


def in_container(root: str = "/") -> bool:
    if os.path.exists(os.path.join(root, ".dockerenv")) or os.path.exists(
        os.path.join(root, "run/.containerenv")
    ):
        return True
    try:
        text = Path(root, "proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "libpod"))


def read_shm(path: str = "/dev/shm") -> tuple[int | None, int | None]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _rlimit(which: int) -> tuple[int, int] | None:
    try:
        soft, hard = resource.getrlimit(which)
    except (OSError, ValueError):
        return None
    unl = resource.RLIM_INFINITY
    return (-1 if soft == unl else soft, -1 if hard == unl else hard)


def read_rdma(root: str = "/") -> list[RdmaDevice]:
    base = Path(root, "sys/class/infiniband")
    devices: list[RdmaDevice] = []
    if not base.is_dir():
        return devices
    for dev_dir in sorted(base.iterdir()):
        dev = RdmaDevice(name=dev_dir.name)
        ports = dev_dir / "ports"
        if ports.is_dir():
            for port in sorted(ports.iterdir()):
                dev.ports.append(
                    {
                        "port": port.name,
                        "state": _read(port / "state") or "?",
                        "link_layer": _read(port / "link_layer") or "?",
                        "rate": _read(port / "rate") or "?",
                    }
                )
        net = dev_dir / "device/net"
        if net.is_dir():
            dev.netdevs = sorted(p.name for p in net.iterdir())
        devices.append(dev)
    return devices


def read_interfaces(root: str = "/", rdma: list[RdmaDevice] | None = None) -> list[NetInterface]:
    """Interfaces in the kernel's order (the order NCCL's getifaddrs() walk sees them)."""
    import psutil

    rdma_by_netdev = {nd: d.name for d in rdma or [] for nd in d.netdevs}
    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    out: list[NetInterface] = []
    for name, entries in addrs.items():
        iface = NetInterface(name=name)
        for entry in entries:
            if entry.family == socket.AF_INET:
                iface.ipv4.append(entry.address)
            elif entry.family == socket.AF_INET6:
                iface.ipv6.append(entry.address.split("%")[0])
        st = stats.get(name)
        if st is not None:
            iface.up, iface.mtu = bool(st.isup), st.mtu or None
            iface.speed_mbps = st.speed or None
        iface.physical = os.path.exists(os.path.join(root, "sys/class/net", name, "device"))
        iface.rdma_device = rdma_by_netdev.get(name)
        out.append(iface)
    return out


def read_master(
    addr: str | None, port: int | None, under_launcher: bool, timeout: float = 2.0, node_rank: int = 0
) -> MasterInfo:
    """Resolve MASTER_ADDR, find whether it is this host, and test only MASTER_ADDR:MASTER_PORT:
    node 0 outside a launcher will host the store there (is the port free?); everyone else
    connects to it (is it reachable?)."""
    info = MasterInfo(addr=addr, port=port)
    if not addr:
        return info
    try:
        found = socket.getaddrinfo(addr, port or None, type=socket.SOCK_STREAM)
        info.resolved = sorted({str(item[4][0]) for item in found})
    except (socket.gaierror, UnicodeError) as exc:
        info.resolve_error = str(exc)
        return info
    local = _local_addresses()
    info.is_local = any(ip in local or ipaddress.ip_address(ip).is_loopback for ip in info.resolved)
    info.route_ip = _route_ip(info.resolved[0])
    if port is None:
        return info
    if info.is_local and not under_launcher and node_rank == 0:
        info.port_free, info.port_error = _port_free(info.resolved[0], port)
    else:
        info.reachable, info.reach_error = _tcp_connect(info.resolved[0], port, timeout)
    return info


def read_torch() -> TorchInfo:
    """torch's versions and devices; imported here so `--help` and the TUI never pay for it."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # ImportError, or a broken CUDA library load
        return TorchInfo(available=False, error=f"{type(exc).__name__}: {exc}")
    info = TorchInfo(available=True, version=str(torch.__version__), cuda_version=torch.version.cuda)
    info.gloo_available = bool(dist.is_available() and dist.is_gloo_available())
    info.nccl_available = bool(dist.is_available() and dist.is_nccl_available())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info.cuda_available = bool(torch.cuda.is_available())
    if not info.cuda_available and caught:
        info.cuda_error = str(caught[-1].message).strip().splitlines()[0]
    if info.nccl_available:
        try:
            ver = torch.cuda.nccl.version()
            info.nccl_version = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
        except Exception:
            info.nccl_version = None
    if info.cuda_available:
        for index in range(torch.cuda.device_count()):
            try:
                props = torch.cuda.get_device_properties(index)
            except Exception as exc:
                info.devices.append({"index": index, "error": str(exc)})
                continue
            bus = None
            # not in every torch build's properties (nor in its type stubs)
            bus_number, device_number = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", 0)
            if bus_number is not None:
                bus = normalise_bus_id(
                    f"{getattr(props, 'pci_domain_id', 0):04x}:{bus_number:02x}:{device_number:02x}.0"
                )
            uuid = str(getattr(props, "uuid", "") or "") or None
            info.devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "bus_id": bus,
                    "uuid": uuid,
                    "memory": int(props.total_memory),
                }
            )
    return info


def _local_addresses() -> set[str]:
    try:
        import psutil

        return {a.address.split("%")[0] for e in psutil.net_if_addrs().values() for a in e}
    except Exception:
        return set()


def _route_ip(ip: str) -> str | None:
    """The source address the kernel picks for `ip`: a UDP connect sends no packet."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _port_free(ip: str, port: int) -> tuple[bool, str | None]:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            s.bind((ip, port))
        except OSError as exc:
            return False, exc.strerror or str(exc)
    return True, None


def _tcp_connect(ip: str, port: int, timeout: float) -> tuple[bool, str | None]:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
        except TimeoutError:
            return False, f"no answer within {timeout:g} s (a firewall drops the packets, or a wrong address)"
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return False, "connection refused (nothing listens on that port yet)"
            return False, exc.strerror or str(exc)
    return True, None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
