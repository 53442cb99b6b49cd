"""Each check against faked systems: the healthy case and the broken ones."""

from __future__ import annotations

import pytest
from preflight_fixtures import (
    GIB,
    acs_pci,
    eth,
    ib_device,
    nvswitch_box,
    pcie_box,
    snapshot,
    torch_ok,
)

from sddoctor.gpu.pci_sysfs import IommuState, PciSnapshot
from sddoctor.gpu.topology import Topology, expected_busbw_gbps
from sddoctor.preflight import checks
from sddoctor.preflight.findings import exit_code, format_findings, sort_findings
from sddoctor.preflight.snapshot import MasterInfo, NetInterface, TorchInfo


def ids(findings, severity=None):
    return {f.id for f in findings if severity is None or f.severity == severity}


def by_id(findings, fid):
    found = [f for f in findings if f.id == fid]
    assert found, f"{fid} not in {[f.id for f in findings]}"
    return found[0]


def test_healthy_nvswitch_box_has_no_warnings():
    findings = checks.run_checks(snapshot())
    assert not ids(findings, "warn") and not ids(findings, "fail"), format_findings(findings)
    assert exit_code(findings) == 0
    matrix = by_id(findings, "topo.matrix")
    assert matrix.evidence[1].split() == ["GPU0", "X"] + ["NVSwitch"] * 7
    assert "NVSwitch: expect ~360 GB/s" in matrix.evidence[9] and "[28 pair(s)]" in matrix.evidence[9]
    # 18 NVLink4 links x 25 GB/s x 0.8 efficiency
    assert "360 GB/s" in matrix.title


def test_expected_busbw_by_topology():
    assert expected_busbw_gbps(nvswitch_box())[0] == pytest.approx(360.0)
    p2p = expected_busbw_gbps(pcie_box(p2p=True))[0]
    no_p2p = expected_busbw_gbps(pcie_box(p2p=False))[0]
    assert p2p == pytest.approx(16 * 1.969 * 0.8, rel=1e-3)
    assert no_p2p < p2p


def test_nvml_unavailable_is_info_without_gpus_and_warn_when_torch_sees_cuda():
    no_gpu = snapshot(topology=Topology(available=False, error="no driver"), torch=torch_ok(0))
    assert by_id(checks.check_gpus(no_gpu), "gpu.nvml_unavailable").severity == "info"
    odd = snapshot(topology=Topology(available=False, error="no driver"), torch=torch_ok(2))
    assert by_id(checks.check_gpus(odd), "gpu.nvml_unavailable").severity == "warn"


def test_gpus_on_the_bus_without_a_driver():
    pci = PciSnapshot(available=True, gpus=["0000:17:00.0", "0000:2a:00.0"])
    snap = snapshot(topology=Topology(available=False, error="Driver Not Loaded"), pci=pci, torch=torch_ok(0))
    (f,) = checks.check_gpus(snap)
    assert f.id == "gpu.driver_not_loaded" and f.severity == "fail" and "0000:17:00.0" in f.evidence[0]


def test_mixed_models_and_degraded_pcie_width():
    topo = pcie_box(2)
    topo.gpus[1].name = "NVIDIA RTX A6000"
    topo.gpus[1].pcie_width = 8
    found = checks.check_gpus(snapshot(topology=topo))
    assert by_id(found, "gpu.mixed_models").severity == "warn"
    assert by_id(found, "gpu.pcie_width_degraded").severity == "warn"
    assert by_id(found, "gpu.pcie_gen_below_max").severity == "info"  # idle gen1: normal
    assert "gpu.pcie_width_degraded" not in ids(checks.check_gpus(snapshot()))


def test_torch_missing_cpu_build_and_driver_too_old():
    assert (
        by_id(
            checks.check_torch(snapshot(torch=TorchInfo(False, "No module named 'torch'"))), "torch.missing"
        ).severity
        == "fail"
    )
    cpu = TorchInfo(available=True, version="2.13.0+cpu", cuda_version=None, gloo_available=True)
    assert by_id(checks.check_torch(snapshot(torch=cpu)), "torch.cpu_build").severity == "fail"
    assert "torch.cpu_build" not in ids(checks.check_torch(snapshot(topology=Topology(False), torch=cpu)))
    old = snapshot()
    old.topology.cuda_driver_version = "11.8"
    assert by_id(checks.check_torch(old), "torch.cuda_newer_than_driver").severity == "fail"
    minor = snapshot()
    minor.topology.cuda_driver_version = "12.4"
    assert by_id(checks.check_torch(minor), "torch.cuda_newer_than_driver").severity == "info"
    assert "torch.cuda_newer_than_driver" not in ids(checks.check_torch(snapshot()))


def test_torch_cannot_use_cuda_and_no_nccl():
    t = torch_ok(8)
    t.cuda_available, t.devices, t.cuda_error = False, [], "The NVIDIA driver on your system is too old"
    f = by_id(checks.check_torch(snapshot(torch=t)), "torch.cuda_unavailable")
    assert f.severity == "fail" and "too old" in f.evidence[0]
    t2 = torch_ok(8)
    t2.nccl_available = False
    assert by_id(checks.check_torch(snapshot(torch=t2)), "torch.no_nccl").severity == "fail"


def test_cuda_visible_devices_invalid_and_empty():
    bad = checks.check_cuda_visible(snapshot(env={"CUDA_VISIBLE_DEVICES": "0,9"}))
    assert by_id(bad, "cuda.visible_devices_invalid").severity == "fail"
    assert "9" in by_id(bad, "cuda.visible_devices_invalid").title
    empty = checks.check_cuda_visible(snapshot(env={"CUDA_VISIBLE_DEVICES": ""}))
    assert "empty" in by_id(empty, "cuda.visible_devices_invalid").title
    uuid = snapshot().topology.gpus[3].uuid
    good = snapshot(env={"CUDA_VISIBLE_DEVICES": f"0,1,{uuid}"}, torch=torch_ok(3))
    assert not checks.check_cuda_visible(good)


def test_cuda_device_order_disagreement():
    topo = pcie_box(2)
    topo.gpus[1].name = "NVIDIA RTX A6000"
    # CUDA's FASTEST_FIRST put the second PCI device first.
    t = torch_ok(2, buses=[topo.gpus[1].bus_id, topo.gpus[0].bus_id])
    found = checks.check_cuda_visible(snapshot(topology=topo, torch=t))
    f = by_id(found, "cuda.device_order")
    assert f.severity == "warn" and "cuda:0 = nvidia-smi GPU1" in f.evidence
    fixed = snapshot(topology=topo, torch=t, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert "cuda.device_order" not in ids(checks.check_cuda_visible(fixed))
    risky = snapshot(
        topology=topo, torch=torch_ok(1, buses=[topo.gpus[0].bus_id]), env={"CUDA_VISIBLE_DEVICES": "0"}
    )
    assert "cuda.device_order" in ids(checks.check_cuda_visible(risky))


def test_torch_sees_fewer_gpus_than_nvml():
    found = checks.check_cuda_visible(snapshot(torch=torch_ok(7)))
    assert by_id(found, "torch.gpu_mismatch").severity == "warn"


def test_pcie_box_without_p2p_and_nvlink_down():
    found = checks.check_topology(snapshot(topology=pcie_box(4, p2p=False)))
    assert by_id(found, "topo.p2p_unsupported").severity == "info"
    matrix = by_id(found, "topo.matrix").evidence
    assert (
        matrix[1].split() == ["GPU0", "X", "PXB*", "PXB*", "PXB*"] and "* = no P2P between the pair" in matrix
    )
    topo = nvswitch_box()
    topo.gpus[5].nvlinks = topo.gpus[5].nvlinks[:12]
    down = by_id(checks.check_topology(snapshot(topology=topo)), "topo.nvlink_down")
    assert down.severity == "warn" and down.evidence == ["GPU5: 12 of 18 links active"]


def test_geforce_p2p_warning():
    found = checks.check_topology(snapshot(topology=pcie_box(2, p2p=True)))
    assert by_id(found, "p2p.geforce").severity == "warn"
    assert "p2p.geforce" not in ids(
        checks.check_topology(snapshot(topology=pcie_box(2, "NVIDIA RTX A6000", p2p=True)))
    )


def test_acs_redirect_on_switch_between_p2p_gpus_fails():
    topo = pcie_box(4, "NVIDIA RTX A6000", p2p=True, ancestor="PIX")
    found = checks.check_acs_iommu(snapshot(topology=topo, pci=acs_pci(bits_on=True)))
    f = by_id(found, "pcie.acs_enabled")
    assert f.severity == "fail" and "ReqRedir+" in f.evidence[0]
    assert "NCCL_P2P_DISABLE=1" in f.remedy and "setpci" in f.remedy
    assert not checks.check_acs_iommu(snapshot(topology=topo, pci=acs_pci(bits_on=False)))
    unknown = checks.check_acs_iommu(snapshot(topology=topo, pci=acs_pci(bits_on=True, readable=False)))
    assert by_id(unknown, "pcie.acs_unknown").severity == "info"
    # No P2P pairs (NVSwitch box): ACS does not matter.
    assert not checks.check_acs_iommu(snapshot(pci=acs_pci(bits_on=True)))


def test_iommu_translation_with_pcie_p2p_warns():
    topo = pcie_box(2, "NVIDIA RTX A6000", p2p=True, ancestor="PIX")
    pci = PciSnapshot(
        available=True, iommu=IommuState(groups=40, cmdline_flags=["intel_iommu=on"], mode="translated")
    )
    f = by_id(checks.check_acs_iommu(snapshot(topology=topo, pci=pci)), "iommu.translated")
    assert f.severity == "warn" and "iommu=pt" in f.remedy
    pci.iommu.mode = "passthrough"
    assert not checks.check_acs_iommu(snapshot(topology=topo, pci=pci))


@pytest.mark.parametrize(
    ("size", "gpus", "container", "severity"),
    [
        (64 * 1024**2, 8, True, "fail"),
        (512 * 1024**2, 8, False, "warn"),
        (64 * 1024**2, 0, True, "info"),
        (16 * GIB, 8, True, "ok"),
    ],
)
def test_shm_size(size, gpus, container, severity):
    topo = nvswitch_box(gpus) if gpus else Topology(False)
    snap = snapshot(
        shm_total=size, shm_free=size, topology=topo, torch=torch_ok(gpus), in_container=container
    )
    f = by_id(checks.check_shm(snap), "shm.size")
    assert f.severity == severity
    if severity == "fail":
        assert "--shm-size" in f.remedy and "--ipc=host" in f.remedy


def test_memlock_matters_with_infiniband_and_nofile_low():
    assert by_id(checks.check_limits(snapshot(memlock=(65536, 65536))), "limits.memlock").severity == "ok"
    ib = snapshot(memlock=(65536, 65536), rdma=[ib_device()])
    assert by_id(checks.check_limits(ib), "limits.memlock").severity == "fail"
    assert by_id(checks.check_limits(snapshot(rdma=[ib_device()])), "limits.memlock").severity == "ok"
    low = by_id(checks.check_limits(snapshot(nofile=(1024, 4096))), "limits.nofile")
    assert low.severity == "warn" and "ulimit -n 4096" in low.remedy


def test_misspelled_unknown_renamed_and_removed_nccl_variables():
    env = {
        "NCCL_P2P_DISABLED": "1",
        "NCCL_FROBNICATE": "1",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_LL_THRESHOLD": "0",
        "NCCL_DEBUG": "INFO",
        "NCCL_VERSION": "2.28.3-1",  # set by NVIDIA's container images: not a setting, not reported
    }
    found = checks.check_nccl_env(snapshot(env=env))
    miss = by_id(found, "nccl.env.misspelled")
    assert miss.severity == "warn" and "NCCL_P2P_DISABLE" in miss.title
    assert by_id(found, "nccl.env.unknown").severity == "info"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in by_id(found, "nccl.env.torch_renamed").title
    assert by_id(found, "nccl.env.removed").severity == "info"
    assert len(found) == 4  # NCCL_DEBUG is known, NCCL_VERSION is not a setting


def test_p2p_disabled_costs_more_on_nvlink():
    nvl = by_id(checks.check_nccl_env(snapshot(env={"NCCL_P2P_DISABLE": "1"})), "nccl.env.p2p_disabled")
    assert nvl.severity == "warn"
    pcie = snapshot(env={"NCCL_P2P_DISABLE": "1"}, topology=pcie_box(2))
    assert by_id(checks.check_nccl_env(pcie), "nccl.env.p2p_disabled").severity == "info"
    both = snapshot(env={"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    assert "nccl.env.shm_disabled" in ids(checks.check_nccl_env(both))


def test_socket_ifname_names_missing_interface():
    found = checks.check_nccl_env(snapshot(env={"NCCL_SOCKET_IFNAME": "ens5"}))
    f = by_id(found, "nccl.env.ifname_missing")
    assert f.severity == "fail" and "eth0" in f.evidence[0]
    assert not checks.check_nccl_env(snapshot(env={"NCCL_SOCKET_IFNAME": "eth"}))
    assert not checks.check_nccl_env(snapshot(env={"NCCL_SOCKET_IFNAME": "=eth0"}))
    assert "nccl.env.ifname_missing" in ids(
        checks.check_nccl_env(snapshot(env={"NCCL_SOCKET_IFNAME": "=eth"}))
    )


def test_ib_disabled_with_active_ib_and_missing_hca():
    f = by_id(
        checks.check_nccl_env(snapshot(env={"NCCL_IB_DISABLE": "1"}, rdma=[ib_device()])),
        "nccl.env.ib_disabled",
    )
    assert f.severity == "warn"
    assert not checks.check_nccl_env(snapshot(env={"NCCL_IB_DISABLE": "1"}, rdma=[ib_device(active=False)]))
    hca = checks.check_nccl_env(snapshot(env={"NCCL_IB_HCA": "mlx4"}, rdma=[ib_device()], nnodes=2))
    assert by_id(hca, "nccl.env.ib_hca_missing").severity == "fail"
    assert not checks.check_nccl_env(snapshot(env={"NCCL_IB_HCA": "mlx5_0:1"}, rdma=[ib_device()]))


def test_nccl_interface_choice_follows_nccl_rules():
    lo = NetInterface("lo", ["127.0.0.1"], up=True)
    docker = NetInterface("docker0", ["172.17.0.1"], up=True)
    br = NetInterface("br-1a2b", ["172.18.0.1"], up=True)
    ib = NetInterface("ib0", ["192.168.1.5"], up=True)
    pick = checks.nccl_socket_candidates
    assert pick([lo, docker, br, eth()], {})[0][0].name == "br-1a2b"  # br-* is not skipped
    assert pick([lo, docker, eth(), ib], {})[0][0].name == "ib0"  # ib* first
    assert pick([lo, docker], {})[0][0].name == "docker0"
    assert pick([lo], {})[0][0].name == "lo"
    assert [i.name for i in pick([lo, docker, br, eth()], {"NCCL_SOCKET_IFNAME": "^br,docker,lo"})[0]] == [
        "eth0"
    ]
    virbr = NetInterface("virbr0", ["192.168.122.1"], up=True)
    down = NetInterface("eth1", ["10.0.0.9"], up=False)
    assert pick([virbr, down, lo], {})[0][0].name == "lo"  # virbr* after lo; a down link never
    assert pick([virbr], {})[0][0].name == "virbr0"


def test_virtual_interface_warns_only_for_multi_node():
    br = NetInterface("br-1a2b", ["172.18.0.1"], up=True)
    single = checks.check_network(snapshot(interfaces=[br, eth()]))
    assert by_id(single, "net.interfaces").severity == "info"
    multi = checks.check_network(snapshot(interfaces=[br, eth()], nnodes=2))
    f = by_id(multi, "net.virtual_interface")
    assert f.severity == "warn" and "NCCL_SOCKET_IFNAME" in f.remedy


def test_route_mismatch_between_master_and_nccl_pick():
    master = MasterInfo(
        addr="10.1.0.1",
        port=29500,
        resolved=["10.1.0.1"],
        is_local=False,
        route_ip="10.1.0.5",
        reachable=True,
    )
    snap = snapshot(interfaces=[eth("eth0", "10.0.0.5"), eth("eth1", "10.1.0.5")], master=master, nnodes=2)
    f = by_id(checks.check_network(snap), "net.route_mismatch")
    assert "eth1" in f.title and "NCCL_SOCKET_IFNAME=eth1" in f.remedy


def test_master_checks():
    assert by_id(checks.check_master(snapshot()), "master.unset").severity == "ok"
    assert by_id(checks.check_master(snapshot(nnodes=2)), "master.unset").severity == "fail"
    bad = MasterInfo(addr="no-such-host.invalid", port=29500, resolve_error="Name or service not known")
    assert by_id(checks.check_master(snapshot(master=bad)), "master.unresolvable").severity == "fail"
    busy = MasterInfo(
        addr="127.0.0.1",
        port=29500,
        resolved=["127.0.0.1"],
        is_local=True,
        port_free=False,
        port_error="Address already in use",
    )
    assert by_id(checks.check_master(snapshot(master=busy)), "master.port_in_use").severity == "fail"
    refused = MasterInfo(
        addr="10.0.0.1",
        port=29500,
        resolved=["10.0.0.1"],
        is_local=False,
        reachable=False,
        reach_error="connection refused (nothing listens on that port yet)",
    )
    assert by_id(checks.check_master(snapshot(master=refused)), "master.unreachable").severity == "warn"
    dropped = MasterInfo(
        addr="10.0.0.1",
        port=29500,
        resolved=["10.0.0.1"],
        is_local=False,
        reachable=False,
        reach_error="no answer within 2 s",
    )
    assert by_id(checks.check_master(snapshot(master=dropped)), "master.unreachable").severity == "fail"
    good = MasterInfo(addr="127.0.0.1", port=29500, resolved=["127.0.0.1"], is_local=True, port_free=True)
    assert by_id(checks.check_master(snapshot(master=good)), "master.ok").severity == "ok"
    noport = MasterInfo(addr="127.0.0.1", resolved=["127.0.0.1"], is_local=True)
    assert by_id(checks.check_master(snapshot(master=noport)), "master.port_unset").severity == "info"


def test_crashing_check_becomes_a_finding_and_ordering_is_worst_first():
    def broken(_snap):
        raise KeyError("boom")

    found = checks.run_checks(snapshot(shm_total=64 * 1024**2), [checks.check_shm, broken])
    assert ids(found) == {"shm.size", "internal.broken"}
    ordered = sort_findings(found)
    assert [f.severity for f in ordered] == ["fail", "warn"]
    assert exit_code(found) == 1  # a failure (docs/exit-codes.md)
    text = format_findings(found)
    assert text.index("FAIL") < text.index("WARN") and "fix:" in text


def test_interfaces_in_snapshot_keep_rdma_link():
    iface = NetInterface("ib0", ["192.168.1.5"], up=True, rdma_device="mlx5_0")
    assert iface.kind == "ipoib"
    assert (
        by_id(checks.check_network(snapshot(interfaces=[iface], rdma=[ib_device()])), "net.rdma").severity
        == "info"
    )
