"""While a collective test runs, torch is read by the test's local rank 0, never by check-nccl itself:
the torch findings come from the worker's report, the parent never imports torch, and a worker that
dies before it reports gives a finding that says so."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from conftest import free_port, subprocess_env
from sddoctor.preflight import checks
from sddoctor.preflight.snapshot import TEST_WORKER_SOURCE, torch_info_from_dict, torch_not_reported

# check-nccl's main(), then the torch modules this process holds at its end, on the last stderr line.
CLI_REPORTING_TORCH = """
import json, sys
from sddoctor.preflight.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
sys.stderr.write("\\nparent torch modules: " + json.dumps(loaded) + "\\n")
sys.exit(code)
"""


def check_nccl_in_subprocess(*args: str, **env: str) -> tuple[int, dict, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", CLI_REPORTING_TORCH, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(**env),
    )
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("parent torch modules: "), out.stderr
    return out.returncode, json.loads(out.stdout), json.loads(last.split(": ", 1)[1])


def by_id(doc: dict, finding_id: str) -> dict:
    (found,) = [f for f in doc["findings"] if f["id"] == finding_id]
    return found


def test_quick_run_takes_torch_facts_from_the_worker_and_never_imports_torch():
    port = str(free_port())
    code, doc, parent_torch = check_nccl_in_subprocess(
        "--quick", "--json", "--backend", "gloo", "--master-addr", "127.0.0.1", "--master-port", port
    )
    assert parent_torch == []
    assert code == doc["exit_code"]
    band = doc["bandwidth"]
    assert band["rows"] and band["rows"][0]["correct"]
    assert not any(psutil.pid_exists(p) for p in band["pids"])
    torch = doc["system"]["torch"]
    assert torch["source"] == TEST_WORKER_SOURCE and not torch["unknown"]
    assert torch["available"] and torch["gloo_available"]
    worker_version = band["ranks_info"][0]["torch"]  # what the ranks told each other in the test
    assert torch["version"] == worker_version
    versions = by_id(doc, "torch.versions")
    assert versions["title"].startswith(f"torch {worker_version},")
    assert f"read by {TEST_WORKER_SOURCE}" in versions["evidence"]
    # The parent looked at the rendezvous port before the test's rank 0 listened on it.
    master = by_id(doc, "master.ok")
    assert master["title"] == f"MASTER_ADDR 127.0.0.1:{port} resolves; port free"


def test_worker_that_dies_before_reporting_torch_is_a_clear_finding():
    code, doc, parent_torch = check_nccl_in_subprocess(
        "--quick", "--json", "--backend", "gloo", "--timeout", "30", SDDOCTOR_PREFLIGHT_FAULT="exit:0"
    )
    assert parent_torch == []
    assert code == doc["exit_code"] == 1  # the dead rank is a failure of the test
    assert "0" in doc["bandwidth"]["crashed"]
    ids = {f["id"] for f in doc["findings"]}
    assert "bw.crash" in ids and not ids & {"torch.versions", "torch.missing"}
    unknown = by_id(doc, "torch.not_reported")
    assert unknown["severity"] == "warn"
    assert "torch's versions and devices are unknown" in unknown["title"]
    assert "local rank 0 (rank 0) exited with code 3 before reporting them" in unknown["evidence"][0]
    assert "torch.gpu_mismatch" in unknown["evidence"][1]  # what could not be checked
    assert doc["system"]["torch"]["unknown"] and not doc["system"]["torch"]["available"]


def test_torch_facts_survive_json_and_unknown_facts_silence_only_the_torch_checks():
    from preflight_fixtures import snapshot, torch_ok

    sent = json.loads(json.dumps({**torch_ok(8).__dict__, "from_a_newer_version": 1}))
    got = torch_info_from_dict(sent, TEST_WORKER_SOURCE)
    assert got.devices == torch_ok(8).devices and got.nccl_version == "2.27.5"
    assert got.source == TEST_WORKER_SOURCE and not got.unknown
    snap = snapshot(torch=torch_not_reported("rank 0 was stopped"))
    found = checks.run_checks(snap)
    torch_ids = [f.id for f in found if f.id.startswith(("torch.", "cuda.", "internal."))]
    assert torch_ids == ["torch.not_reported"]
    assert "gpu.inventory" in {f.id for f in found}  # NVML-side checks are unaffected


def test_rank_zero_stuck_before_reporting_is_named_with_the_timeout(monkeypatch):
    from sddoctor.preflight import bandwidth as bw
    from sddoctor.preflight.api import torch_from_test

    monkeypatch.setenv(bw.FAULT_ENV, "hang:0")
    result = bw.run_bandwidth_test(2, bw.SweepPlan(ops={"all_reduce": [4096]}), backend="gloo", timeout=6)
    assert result.timed_out and result.torch is None
    assert not any(psutil.pid_exists(p) for p in result.pids)
    facts = torch_from_test(result)
    assert facts.unknown and facts.error == (
        "the collective test's local rank 0 (rank 0) had not reported them after 6 s and was stopped"
    )
