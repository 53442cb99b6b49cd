"""check-nccl on a real CUDA machine (skipped without CUDA): NVML topology, NCCL sweep, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import subprocess_env

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def torch():
    """Imported here, not at collection, so CPU-only runs do not pay for importing torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def test_nvml_topology_matches_torch(torch):
    from sddoctor.gpu.topology import read_topology

    topo = read_topology()
    assert topo.available, topo.error
    assert len(topo.gpus) >= torch.cuda.device_count()
    assert topo.driver_version and topo.cuda_driver_version
    n = len(topo.gpus)
    assert len(topo.pairs) == n * (n - 1) // 2


def test_nccl_sweep_on_every_gpu(torch):
    from sddoctor.preflight import bandwidth as bw

    n = torch.cuda.device_count()
    plan = bw.SweepPlan(
        ops={"all_reduce": [1024**2, 64 * 1024**2], "all_gather": [16 * 1024**2], "broadcast": [16 * 1024**2]}
    )
    result = bw.run_bandwidth_test(n, plan, backend="nccl", timeout=120)
    assert result.ok, result
    # one rank runs the all-reduce sizes only (nothing crosses a link): 2 rows; several ranks run all 4
    assert all(r.correct for r in result.rows) and len(result.rows) == (4 if n >= 2 else 2)
    if n >= 2:
        assert all(r.busbw > 0 for r in result.rows)
    else:
        assert result.local_copy_gbps and result.local_copy_gbps > 10


def test_cli_quick_json_uses_nccl(torch):
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "check-nccl", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    doc = json.loads(out.stdout)
    assert out.returncode == doc["exit_code"]
    assert doc["bandwidth"]["backend"] == "nccl" and doc["bandwidth"]["rows"][0]["correct"]
    assert doc["system"]["gpus"]
    # torch was read by the test's local rank 0, with the same visible devices as this process.
    facts = doc["system"]["torch"]
    assert facts["source"] == "the collective test's local rank 0" and facts["cuda_available"]
    assert len(facts["devices"]) == torch.cuda.device_count() and facts["nccl_version"]
    assert facts["version"] == doc["bandwidth"]["ranks_info"][0]["torch"]
