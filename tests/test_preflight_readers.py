"""The data layer: NVML read through a fake pynvml, sysfs read from a fake tree, host readers for real."""

from __future__ import annotations

import socket

import pytest
from preflight_fixtures import FakeNvml, acs_config, fake_sysfs

from sddoctor.gpu import nvml as nvml_mod
from sddoctor.gpu.pci_sysfs import link_gen, parse_acs_config, parse_lspci_acsctl, read_pci
from sddoctor.gpu.topology import normalise_bus_id, read_topology
from sddoctor.preflight.snapshot import read_env, read_master, read_rdma, read_shm


@pytest.fixture
def fake_nvml():
    def install(module, error=None):
        nvml_mod.set_nvml_for_tests(module, error)

    yield install
    nvml_mod.set_nvml_for_tests(None, None)


def test_nvml_nvlink_pairs(fake_nvml):
    buses = ["00000000:18:00.0", "00000000:2A:00.0"]
    gpus = [
        {"name": "NVIDIA A100-SXM4-80GB", "bus": buses[0], "links": [buses[1]] * 4},
        {"name": "NVIDIA A100-SXM4-80GB", "bus": buses[1], "links": [buses[0]] * 4, "width": 8},
    ]
    fake_nvml(FakeNvml(gpus, ancestor=50))
    topo = read_topology()
    assert topo.available and topo.driver_version == "570.86.15" and topo.cuda_driver_version == "12.8"
    assert [g.bus_id for g in topo.gpus] == ["0000:18:00.0", "0000:2a:00.0"]
    assert topo.gpus[1].pcie_width == 8 and len(topo.gpus[0].nvlinks) == 4
    (pair,) = topo.pairs
    assert pair.label == "NV4" and pair.kind == "nvlink" and pair.ancestor == "SYS" and pair.p2p_ok
    assert topo.pair(1, 0) is pair


def test_nvml_nvswitch_and_pcie_pairs(fake_nvml):
    switch = "00000000:FF:00.0"
    gpus = [
        {"name": "NVIDIA H200", "bus": f"00000000:{b}:00.0", "links": [switch] * 18}
        for b in ("18", "2A", "3A")
    ]
    fake_nvml(FakeNvml(gpus))
    topo = read_topology()
    assert all(p.via_nvswitch and p.label == "NVSwitch" for p in topo.pairs) and len(topo.pairs) == 3
    pcie = [{"name": "NVIDIA GeForce RTX 4090", "bus": f"00000000:{b}:00.0"} for b in ("41", "42")]
    fake_nvml(FakeNvml(pcie, ancestor=10, p2p=1))
    topo = read_topology()
    (pair,) = topo.pairs
    assert pair.label == "PIX" and pair.kind == "pcie" and pair.p2p_read == "chipset not supported"
    assert pair.p2p_nvlink == "not supported"


def test_nvml_unavailable_is_a_reason_not_a_crash(fake_nvml):
    fake_nvml(None, "NVML could not start (Driver Not Loaded)")
    topo = read_topology()
    assert not topo.available and "Driver Not Loaded" in topo.error


def test_bus_id_forms():
    assert normalise_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalise_bus_id("0000:1a:00.0") == "0000:1a:00.0"
    assert normalise_bus_id("1A:00.0") == "0000:1a:00.0"


def test_sysfs_tree_with_acs_on_and_translated_iommu(tmp_path):
    root = fake_sysfs(tmp_path, acs_ctl=0b1101, iommu_type="DMA-FQ", cmdline="quiet intel_iommu=on")
    snap = read_pci(root, use_lspci=False)
    assert snap.available and snap.gpus == ["0000:03:00.0", "0000:04:00.0"]
    gpu = snap.devices["0000:04:00.0"]
    assert gpu.upstream == ["0000:00:01.0", "0000:01:00.0", "0000:02:01.0"]
    assert gpu.link_width == 8 and gpu.link_width_max == 16 and link_gen(gpu.link_speed) == 4
    bridge = snap.devices["0000:01:00.0"]
    assert bridge.is_bridge and bridge.acs_source == "config"
    assert bridge.acs_ctl["SrcValid"] and bridge.acs_ctl["ReqRedir"] and bridge.acs_ctl["CmpltRedir"]
    assert not bridge.acs_ctl["TransBlk"] and bridge.acs_redirects_p2p
    assert snap.acs_readable
    assert snap.iommu.mode == "translated" and snap.iommu.cmdline_flags == ["intel_iommu=on"]


def test_sysfs_tree_without_root_and_passthrough(tmp_path):
    root = fake_sysfs(tmp_path, acs_ctl=None, iommu_type="identity", cmdline="iommu=pt")
    snap = read_pci(root, use_lspci=False)
    assert not snap.acs_readable and snap.devices["0000:01:00.0"].acs_ctl is None
    assert snap.iommu.mode == "passthrough"
    nothing = read_pci(tmp_path / "missing", use_lspci=False)
    assert not nothing.available and nothing.gpus == []


def test_sysfs_without_iommu_groups_is_off(tmp_path):
    root = fake_sysfs(tmp_path, acs_ctl=0, iommu_type=None)
    snap = read_pci(root, use_lspci=False)
    assert snap.iommu.mode == "off" and snap.devices["0000:01:00.0"].acs_redirects_p2p is False


def test_acs_parsers():
    assert parse_acs_config(bytes(64)) is None
    assert parse_acs_config(acs_config(0x1))["SrcValid"]
    text = "\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+\n\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-\n"
    ctl = parse_lspci_acsctl(text)
    assert ctl["ReqRedir"] and ctl["UpstreamFwd"] and not ctl["EgressCtrl"]
    assert parse_lspci_acsctl("Capabilities: <access denied>") is None


def test_host_readers_on_this_machine(tmp_path):
    total, free = read_shm("/dev/shm")
    assert total is None or total >= free >= 0
    assert read_shm(str(tmp_path / "nope")) == (None, None)
    env = read_env(
        {"NCCL_DEBUG": "INFO", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    )
    assert env == {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    ib = tmp_path / "sys/class/infiniband/mlx5_0"
    (ib / "ports/1").mkdir(parents=True)
    (ib / "ports/1/state").write_text("4: ACTIVE\n")
    (ib / "ports/1/link_layer").write_text("Ethernet\n")
    (ib / "device/net/ens1f0").mkdir(parents=True)
    (dev,) = read_rdma(str(tmp_path))
    assert dev.active and dev.netdevs == ["ens1f0"] and dev.ports[0]["link_layer"] == "Ethernet"


def test_master_port_free_in_use_and_reachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        busy = read_master("127.0.0.1", port, under_launcher=False)
        assert busy.is_local and busy.port_free is False
        reach = read_master("127.0.0.1", port, under_launcher=True)
        assert reach.reachable is True
    free = read_master("localhost", port, under_launcher=False)
    assert free.port_free is True and free.resolved
    refused = read_master("127.0.0.1", port, under_launcher=True, timeout=1.0)
    assert refused.reachable is False and "refused" in refused.reach_error
    bad = read_master("no-such-host.invalid", 29500, under_launcher=False)
    assert bad.resolve_error and bad.reachable is None
