"""`sddoctor check-nccl` as a user runs it: exit codes, --json schema, usage errors, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import main_without_torch, subprocess_env


def check_nccl(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sddoctor", "check-nccl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
    )


def test_help_does_not_import_torch_and_documents_exit_codes():
    out = main_without_torch("sddoctor.preflight.cli", ["--help"])
    assert out.returncode == 0, out.stderr
    assert "exit codes (one table for every sddoctor command" in out.stdout and "--quick" in out.stdout
    assert "2      usage error" in out.stdout and "3      warnings, and no failure" in out.stdout


def test_usage_errors_exit_2_without_traceback():
    for args, words in (
        (["--sizes", "12Q"], "--sizes"),
        (["--nnodes", "2"], "--master-addr"),
        (["--node-rank", "3"], "--node-rank"),
        (["--bogus"], "unrecognized arguments"),
        (["--timeout", "-1"], "--timeout"),
    ):
        out = check_nccl(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert words in out.stderr and "Traceback" not in out.stderr


def test_checks_only_exit_codes_follow_worst_severity(monkeypatch, capsys):
    # In-process, on a faked healthy 8-GPU box (the snapshot is the seam) so the result does not
    # depend on the machine the tests run on; the environment is still read for real.
    from preflight_fixtures import snapshot, torch_ok

    from sddoctor.preflight import api
    from sddoctor.preflight.cli import main
    from sddoctor.preflight.snapshot import read_env

    monkeypatch.setattr(api, "collect_snapshot", lambda **_: snapshot(env=read_env(os.environ)))
    monkeypatch.setattr(api, "read_torch", lambda: torch_ok(8))
    for name in [k for k in os.environ if k.startswith("NCCL_")] + ["CUDA_VISIBLE_DEVICES", "MASTER_ADDR"]:
        monkeypatch.delenv(name, raising=False)
    assert main(["--no-bandwidth", "--all", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "result: OK (exit 0)" in out and "shm.size" in out
    monkeypatch.setenv("NCCL_P2P_DISABLED", "1")
    assert main(["--no-bandwidth", "--color", "never"]) == 3  # warnings (docs/exit-codes.md)
    out = capsys.readouterr().out
    assert "nccl.env.misspelled" in out and "NCCL_P2P_DISABLED" in out and "result: WARNINGS (exit 3)" in out
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuch0")
    assert main(["--no-bandwidth", "--color", "never"]) == 1  # a failure
    out = capsys.readouterr().out
    assert "nccl.env.ifname_missing" in out and "fix:" in out and out.index("FAIL") < out.index("WARN")


def test_rank_that_never_joins_is_a_failure_within_the_timeout_and_nothing_is_left():
    import time

    import psutil

    started = time.monotonic()
    out = check_nccl(
        "--quick", "--json", "--backend", "gloo", "--timeout", "8", SDDOCTOR_PREFLIGHT_FAULT="hang:1"
    )
    assert time.monotonic() - started < 8 + 20  # the timeout plus starting Python and torch
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    band = doc["bandwidth"]
    assert band["timed_out"] and band["elapsed"] < 8 + 3
    assert band["never_joined"] == [1] and band["waiting_in_init"] == [0] and band["rows"] == []
    assert len(band["pids"]) == 2 and not any(psutil.pid_exists(p) for p in band["pids"])
    (hang,) = [f for f in doc["findings"] if f["id"] == "bw.hang"]
    assert hang["severity"] == "fail" and "rank(s) 1" in hang["title"]
    assert "never reached init_process_group: rank(s) 1" in hang["evidence"]


def test_every_finding_id_is_documented():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "".join(p.read_text() for p in (root / "sddoctor/preflight").glob("*.py"))
    ids = set(
        re.findall(
            r'"((?:gpu|torch|cuda|topo|p2p|pcie|iommu|shm|limits|nccl\.env|net|master|bw|nodes)\.[a-z_]+)"',
            code,
        )
    )
    assert len(ids) > 40
    doc = (root / "docs/check-nccl.md").read_text()
    missing = sorted(i for i in ids if f"`{i}`" not in doc)
    assert not missing, f"finding ids missing from docs/check-nccl.md: {missing}"


def test_ctrl_c_stops_every_test_process():
    import signal
    import time

    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "sddoctor", "check-nccl", "--quick", "--backend", "gloo", "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(SDDOCTOR_PREFLIGHT_FAULT="hang:1"),
        # A shell's background jobs inherit SIGINT ignored, and Python then never raises
        # KeyboardInterrupt: give the command the disposition a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        workers: list[psutil.Process] = []
        while time.monotonic() < deadline and len(workers) < 2:
            workers = [
                c for c in parent.children() if "sddoctor.preflight.bandwidth" in " ".join(c.cmdline())
            ]
            time.sleep(0.2)
        assert len(workers) == 2, "the test processes did not start"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_json_with_a_faked_nvswitch_box(monkeypatch, capsys):
    # NVML faked at its edge: the whole path from readings to findings to JSON on an 8-GPU box.
    from preflight_fixtures import FakeNvml

    from sddoctor.gpu.nvml import set_nvml_for_tests
    from sddoctor.preflight import api
    from sddoctor.preflight.cli import main
    from sddoctor.preflight.snapshot import TorchInfo

    switch = "00000000:FF:00.0"
    gpus = [
        {"name": "NVIDIA H200", "bus": f"00000000:{0x18 + i:02X}:00.0", "links": [switch] * 18}
        for i in range(8)
    ]
    set_nvml_for_tests(FakeNvml(gpus, ancestor=50))
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    cpu_torch = TorchInfo(available=True, version="2.13.0+cpu", gloo_available=True)
    monkeypatch.setattr(api, "read_torch", lambda: cpu_torch)  # the same on a CUDA machine
    try:
        code = main(["--no-bandwidth", "--json"])
    finally:
        set_nvml_for_tests(None, None)
    doc = json.loads(capsys.readouterr().out)
    assert code == doc["exit_code"] == 1  # this torch is a CPU build on a GPU box: torch.cpu_build
    found = {f["id"]: f for f in doc["findings"]}
    assert found["torch.cpu_build"]["severity"] == "fail"
    assert found["nccl.env.p2p_disabled"]["severity"] == "warn"  # NVLink box
    assert "8 GPU(s): NVIDIA H200" in found["gpu.inventory"]["title"]
    assert "360 GB/s" in found["topo.matrix"]["title"]
    system = doc["system"]
    assert len(system["gpus"]) == 8 and len(system["gpus"][0]["nvlinks"]) == 18
    assert len(system["pairs"]) == 28 and {p["label"] for p in system["pairs"]} == {"NVSwitch"}
    assert system["driver_version"] == "570.86.15" and system["cuda_driver_version"] == "12.8"


def test_two_nodes_on_one_machine_join_one_process_group():
    from conftest import free_port

    port = str(free_port())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "1"]
    common += ["--sizes", "4K", "--json", "--timeout", "60", "--backend", "gloo"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "sddoctor", "check-nccl", *common, "--node-rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in nodes]
    docs = [json.loads(out) for out, _ in outs]
    for doc, proc in zip(docs, nodes, strict=True):
        assert proc.returncode == doc["exit_code"]
        failed = [f for f in doc["findings"] if f["severity"] == "fail"]
        assert not [f for f in failed if f["id"].startswith(("bw.", "nodes.", "master."))], failed
        band = doc["bandwidth"]
        assert band["world_size"] == 2 and band["local_ranks"] == 1 and band["rows"]
        assert sorted(i["rank"] for i in band["ranks_info"]) == [0, 1]
        ids = {f["id"] for f in doc["findings"]}
        assert "nodes.versions" in ids and "master.unreachable" not in ids
    assert [r["busbw"] for r in docs[0]["bandwidth"]["rows"]] == [
        r["busbw"] for r in docs[1]["bandwidth"]["rows"]
    ]
    assert_schema(docs[0])


def assert_schema(doc: dict) -> None:
    assert doc["schema"] == "sddoctor.check-nccl/1"
    assert {
        "sddoctor_version",
        "host",
        "time",
        "elapsed_s",
        "worst",
        "findings",
        "bandwidth",
        "system",
    } <= set(doc)
    for f in doc["findings"]:
        assert set(f) == {"id", "severity", "title", "evidence", "remedy"}
        assert f["severity"] in ("ok", "info", "warn", "fail")
    order = ["fail", "warn", "info", "ok"]
    ranks = [order.index(f["severity"]) for f in doc["findings"]]
    assert ranks == sorted(ranks)
    assert doc["worst"] == order[ranks[0]]
    band = doc["bandwidth"]
    assert band["backend"] == "gloo" and band["device"] == "cpu"
    assert [r["op"] for r in band["rows"]] == ["all_reduce", "all_gather", "broadcast"]
    for row in band["rows"]:
        assert set(row) == {
            "op",
            "size",
            "count",
            "iters",
            "time_us",
            "algbw",
            "busbw",
            "correct",
            "wrong_ranks",
        }
        assert row["size"] == 4096 and row["correct"]
    for key in (
        "never_joined",
        "waiting_in_init",
        "hung",
        "crashed",
        "timed_out",
        "pids",
        "error",
        "ranks_info",
    ):
        assert key in band
    assert {"torch", "env", "interfaces", "master", "gpus", "pairs", "iommu", "shm_bytes"} <= set(
        doc["system"]
    )
    assert doc["system"]["master"]["addr"] == "127.0.0.1"


def test_python_entry_for_run_and_the_trainer(monkeypatch):
    import psutil

    from sddoctor.preflight import Finding, format_findings, run_preflight

    monkeypatch.setenv("NCCL_IB_DISABEL", "1")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    findings = run_preflight(quick=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before  # checks only
    assert all(isinstance(f, Finding) for f in findings)
    assert "bw.result" not in {f.id for f in findings}
    text = format_findings(findings, min_severity="warn")
    assert "nccl.env.misspelled" in text and "NCCL_IB_DISABLE" in text
    assert "torch.versions" not in text  # ok findings are left out at min_severity="warn"
