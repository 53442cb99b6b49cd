"""The state endpoint on a real socket with real clients, and /metrics read by Prometheus' parser."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from supervise_fixtures import run_supervised

from conftest import free_port, subprocess_env
from sddoctor.supervise import http as endpoint
from sddoctor.supervise.http import StateServer
from sddoctor.supervise.metrics import RunMetrics
from sddoctor.supervise.state import Verdict
from sddoctor.supervise.watch import Watcher
from sddoctor.telemetry import RunDir, TelemetryWriter
from sddoctor.telemetry.runinfo import RunOptions

TOKEN = "t0ken-for-tests-0123456789"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


@pytest.fixture
def quick_limits(monkeypatch):
    """Shorter idle and request deadlines than the defaults (5 s, 10 s), so the test is quick."""
    monkeypatch.setattr(endpoint, "IDLE_TIMEOUT", 1.0)
    monkeypatch.setattr(endpoint, "REQUEST_DEADLINE", 2.0)


def _state() -> dict:
    return {
        "run": {"command": ["torchrun", "train.py", "--hub-token", "hf_secret", "--api-key=k1"]},
        "ranks": {},
    }


def test_a_token_is_required_when_set_and_the_command_line_is_redacted():
    server = StateServer(_state, "127.0.0.1", 0, token=TOKEN).start()
    try:
        code, body, headers = _get(server.url + "/api/state")
        assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        code, _, _ = _get(server.url + "/api/state", {"Authorization": "Bearer wrong-token-wrong-token"})
        assert code == 401
        code, _, _ = _get(server.url + "/metrics")
        assert code == 401
        code, body, _ = _get(server.url + "/api/state", {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200
        state = json.loads(body)
        assert state["schema"] == "sddoctor.state/1"
        assert state["run"]["command"] == [
            "torchrun",
            "train.py",
            "--hub-token",
            "REDACTED",
            "--api-key=REDACTED",
        ]
        assert b"hf_secret" not in body
    finally:
        server.stop()


def test_loopback_without_token_refuses_foreign_host_headers():
    server = StateServer(_state, "127.0.0.1", 0).start()
    try:
        assert _get(server.url + "/api/state")[0] == 200
        assert _get(server.url + "/api/state", {"Host": f"localhost:{server.port}"})[0] == 200
        assert _get(server.url + "/api/state", {"Host": "attacker.example:80"})[0] == 403  # DNS rebinding
    finally:
        server.stop()


def test_a_silent_client_is_closed_and_blocks_nobody(quick_limits):
    server = StateServer(_state, "127.0.0.1", 0).start()
    try:
        silent = socket.create_connection(("127.0.0.1", server.port))
        dripping = socket.create_connection(("127.0.0.1", server.port))
        dripping.sendall(b"GET /api/state HTTP/1.0\r\n")
        started = time.monotonic()
        assert _get(server.url + "/api/state")[0] == 200  # served while the other two hang on
        assert time.monotonic() - started < 1.0
        # a header line every 0.6 s never trips the 1 s idle timeout: only the 2 s deadline ends it
        cut_off = None
        while time.monotonic() - started < 6.0:
            time.sleep(0.6)
            try:
                dripping.sendall(b"X-Slow: 1\r\n")
            except OSError:
                cut_off = time.monotonic() - started
                break
        assert cut_off is not None and cut_off < 2.0 + 2.0, cut_off
        silent.settimeout(10)
        assert silent.recv(1024) == b""  # closed by the server after the idle timeout
    finally:
        server.stop()


def test_request_size_and_bodies_are_bounded():
    server = StateServer(_state, "127.0.0.1", 0).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.putrequest("GET", "/api/state")
        for i in range(40):
            conn.putheader(f"X-Filler-{i}", "x" * 500)  # 20 KB of headers
        conn.endheaders()
        assert conn.getresponse().status == 431
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/api/state", body=b"x" * 100)
        assert conn.getresponse().status == 413
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/api/state", body=b"{}")
        assert conn.getresponse().status == 413  # no body is read, whatever the method
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("DELETE", "/api/state")
        assert conn.getresponse().status == 501  # GET and HEAD only
    finally:
        server.stop()


def test_too_many_connections_from_one_client_are_refused(monkeypatch, quick_limits):
    monkeypatch.setattr(endpoint, "MAX_PER_CLIENT", 3)
    server = StateServer(_state, "127.0.0.1", 0).start()
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(5)
        assert extra.recv(1024) == b""  # closed at once, not queued behind the idle ones
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while _get_or_none(server.url + "/api/state") != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        server.stop()


def _get_or_none(url: str) -> int | None:
    try:
        return _get(url)[0]
    except OSError:
        return None


def _metrics_families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_metrics_of_a_run_directory_scraped_by_the_prometheus_parser(tmp_path):
    rd = RunDir(tmp_path).ensure()
    writers = {r: TelemetryWriter(rd, r, start_thread=False) for r in (0, 1)}
    watcher = Watcher(rd, options=RunOptions(hang_timeout=300, straggler_ratio=2), started=time.time())
    metrics = RunMetrics(rd, node="node0")
    now = time.time()
    for r, w in writers.items():
        w.emit("start", pid=os.getpid(), host="node0", world_size=2)
        for step in range(1, 4):
            w.emit("step", step=step, loss=0.5, samples=4, step_time=0.2 * (r + 1))
    writers[1].emit("oom", step=2, phase="backward")
    writers[1].emit("fallback", step=2, old_micro_batch=4, new_micro_batch=2)
    for r, w in writers.items():
        done = {
            "pg": "0",
            "seq": 5,
            "op": "all_reduce",
            "t": now,
            "duration": 0.003 * (r + 1),
            "since": now - 0.01,
        }
        w.update_state(
            step=3,
            last_step={"step": 3, "loss": 0.5, "samples": 4, "step_time": 0.2, "mem_alloc": 1 << 30},
            heartbeat=now,
            collectives={
                "inflight": [],
                "issued": {"0": 5, "1": 2},
                "last_done": done,
                "totals": {"count": 5, "seconds": 0.1},
            },
        )
        w.flush()
    watcher.poll(now)
    metrics.update(watcher.state(now), [])
    # next tick: the last completed collective is on another group; the pg="0" series stays
    for w in writers.values():
        done = {"pg": "1", "seq": 2, "op": "broadcast", "t": now + 1, "duration": 0.001, "since": now + 0.99}
        w.update_state(collectives={"inflight": [], "issued": {"0": 5, "1": 2}, "last_done": done})
        w.flush()
    watcher.poll(now + 1)
    verdict = Verdict(kind="straggler", severity="warning", summary="s", culprit_rank=1)
    metrics.update(watcher.state(now + 1), [verdict])
    body, ctype = metrics.render("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    fams = _metrics_families(body)
    steps = {
        s.labels["rank"]: s.value for s in fams["sddoctor_steps"].samples if s.name == "sddoctor_steps_total"
    }
    assert steps == {"0": 3.0, "1": 3.0}
    assert fams["sddoctor_steps"].type == "counter"
    hist = fams["sddoctor_step_seconds"]
    assert hist.type == "histogram"
    count = {s.labels["rank"]: s.value for s in hist.samples if s.name == "sddoctor_step_seconds_count"}
    assert count == {"0": 3.0, "1": 3.0}
    le_025 = {
        s.labels["rank"]: s.value
        for s in hist.samples
        if s.name.endswith("_bucket") and s.labels["le"] == "0.25"
    }
    assert le_025 == {"0": 3.0, "1": 0.0}  # rank 1's steps took 0.4 s
    seqs = {
        (s.labels["rank"], s.labels["pg"]): s.value for s in fams["sddoctor_rank_last_collective_seq"].samples
    }
    assert seqs == {("0", "0"): 5, ("0", "1"): 2, ("1", "0"): 5, ("1", "1"): 2}  # one series per pg, kept
    issued = {(s.labels["rank"], s.labels["pg"]): s.value for s in fams["sddoctor_collectives"].samples}
    assert issued[("0", "0")] == 5
    fallbacks = {s.labels["rank"]: s.value for s in fams["sddoctor_oom_fallbacks"].samples}
    assert fallbacks == {"0": 0.0, "1": 1.0}
    (v,) = fams["sddoctor_verdict"].samples
    assert (
        v.labels == {"node": "node0", "kind": "straggler", "severity": "warning", "rank": "1"}
        and v.value == 1
    )
    waits = [s for s in fams["sddoctor_collective_wait_seconds"].samples if s.name.endswith("_count")]
    assert {(s.labels["rank"], s.labels["pg"]) for s in waits} >= {("0", "0"), ("1", "0")}
    assert all(s.labels.get("node") for f in fams.values() for s in f.samples)  # every series says where
    body, ctype = metrics.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_metrics_with_gpus_through_a_fake_nvml(tmp_path):
    from sddoctor.gpu.nvml import set_nvml_for_tests
    from sddoctor.gpu.source import NvmlSource
    from sddoctor.testing.fake_nvml import FakeNvml, demo_gpus

    set_nvml_for_tests(FakeNvml(demo_gpus(2, [[]] * 2)))
    try:
        source = NvmlSource(pcie_interval=0)
        metrics = RunMetrics(RunDir(tmp_path).ensure(), gpu_source=source, node="n")
        fams = _metrics_families(metrics.render("")[0])
    finally:
        set_nvml_for_tests(None)
    temps = fams["sddoctor_gpu_temperature_celsius"].samples
    assert {s.labels["gpu"] for s in temps} == {"0", "1"}
    util = fams["sddoctor_gpu_utilization_ratio"].samples
    assert all(0.0 <= s.value <= 1.0 for s in util)


def test_run_off_loopback_makes_a_token_and_serves_only_with_it(tmp_path):
    port = free_port()
    script = tmp_path / "client.py"
    script.write_text(
        "import os, json, urllib.request, urllib.error\n"
        "run = os.environ['SDDOCTOR_RUN_DIR']\n"
        f"url = 'http://127.0.0.1:{port}/api/state'\n"
        "token = open(os.path.join(run, 'endpoint.token')).read().strip()\n"
        "try:\n"
        "    urllib.request.urlopen(url, timeout=5)\n"
        "    print('OPEN DOOR')\n"
        "except urllib.error.HTTPError as e:\n"
        "    print('refused', e.code)\n"
        "req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})\n"
        "state = json.load(urllib.request.urlopen(req, timeout=5))\n"
        "print('served', state['schema'], 'SDDOCTOR_TOKEN' in os.environ)\n"
    )
    res = run_supervised(
        tmp_path,
        [sys.executable, str(script), "--password", "hunter2"],
        options=("--bind", "0.0.0.0", "--port", str(port)),
    )
    assert res.returncode == 0, res.stderr
    assert "refused 401" in res.stdout and "served sddoctor.state/1 False" in res.stdout
    token = (res.run_dir / "endpoint.token").read_text().strip()
    assert stat.S_IMODE(os.stat(res.run_dir / "endpoint.token").st_mode) == 0o600
    assert res.stderr.count(token) == 1  # printed once
    assert "hunter2" not in (res.run_dir / "run.json").read_text()
    assert "hunter2" not in (res.run_dir / "report.json").read_text()
    assert res.report["run"]["command"][-1] == "REDACTED"


def test_a_chosen_port_that_is_taken_is_a_usage_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "sddoctor",
                "run",
                "--port",
                str(port),
                "--",
                sys.executable,
                "-c",
                "pass",
            ],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
    assert out.returncode == 2, out.stderr
    assert f"port {port}" in out.stderr and "--port 0" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "sddoctor-runs").exists()  # nothing was created


def test_the_default_port_taken_falls_back_to_a_free_one(tmp_path):
    blocker = socket.socket()
    try:
        try:
            blocker.bind(("127.0.0.1", endpoint.DEFAULT_PORT))
            blocker.listen()
        except OSError:
            pass  # already taken by another process: the same situation
        res = run_supervised(tmp_path, [sys.executable, "-c", "pass"], options=())
    finally:
        blocker.close()
    assert res.returncode == 0, res.stderr
    assert f"port {endpoint.DEFAULT_PORT} is taken" in res.stderr
    url = json.loads((res.run_dir / "run.json").read_text())["endpoint"]
    assert not url.endswith(f":{endpoint.DEFAULT_PORT}")


def test_insecure_serves_without_a_token_and_says_so(tmp_path):
    res = run_supervised(
        tmp_path,
        [sys.executable, "-c", "pass"],
        options=("--bind", "0.0.0.0", "--port", "0", "--insecure"),
    )
    assert res.returncode == 0, res.stderr
    assert "--insecure: anyone who can reach" in res.stderr
    assert not (res.run_dir / "endpoint.token").exists()


def test_peers_send_the_token():
    server = StateServer(lambda: {"ranks": {"3": {"step": 1}}}, "127.0.0.1", 0, token=TOKEN).start()
    try:
        with pytest.raises(urllib.error.HTTPError):
            endpoint.get_state(f"127.0.0.1:{server.port}", None)
        state = endpoint.get_state(f"127.0.0.1:{server.port}", TOKEN)
        assert state["ranks"]["3"]["step"] == 1
    finally:
        server.stop()
