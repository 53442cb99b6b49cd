"""The state endpoint of `sddoctor run`: GET /api/state (JSON) and GET /metrics (Prometheus text).

A stdlib `ThreadingHTTPServer` in a daemon thread. It serves a snapshot that the supervisor
loop publishes once a second, so a slow client never touches the watcher's data.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

StateProvider = Callable[[], dict[str, Any]]


class StateServer:
    def __init__(self, provider: StateProvider, host: str = "127.0.0.1", port: int = 0) -> None:
        self.provider = provider
        handler = _make_handler(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="sddoctor-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StateServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=2.0)


def _make_handler(server: StateServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/api/state":
                body = json.dumps(server.provider(), default=str).encode()
                self._send(200, "application/json", body)
            elif path == "/metrics":
                body = prometheus_text(server.provider()).encode()
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", body)
            elif path == "":
                self._send(200, "text/plain", b"sddoctor run: GET /api/state or /metrics\n")
            else:
                self._send(404, "text/plain", b"not found: try /api/state or /metrics\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass  # the job's terminal is not ours to fill

    return Handler


def prometheus_text(state: dict[str, Any], now: float | None = None) -> str:
    """Per-rank gauges: step, loss, last collective seq, seconds in the current collective, hang flag."""
    now = time.time() if now is None else now
    verdicts = state.get("verdicts") or []
    hang = any(str(v.get("kind", "")).startswith("hang.") for v in verdicts)
    metrics: dict[str, tuple[str, list[str]]] = {
        "sddoctor_rank_step": ("Last finished training step reported by the rank.", []),
        "sddoctor_rank_loss": ("Loss of the last step.", []),
        "sddoctor_rank_last_collective_seq": (
            "Seq of the last completed collective (per process group).",
            [],
        ),
        "sddoctor_rank_collective_inflight_seconds": (
            "Seconds the rank has been inside its current collective.",
            [],
        ),
        "sddoctor_rank_alive": ("1 while the rank process runs.", []),
        "sddoctor_hang": ("1 when sddoctor has diagnosed a hang.", []),
        "sddoctor_verdicts": ("Number of current verdicts.", []),
    }
    host = (state.get("node") or {}).get("host", "")
    for key, rank in sorted((state.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        labels = f'rank="{key}",host="{_esc(str(rank.get("host") or host))}"'
        if isinstance(rank.get("step"), (int, float)):
            metrics["sddoctor_rank_step"][1].append(f"sddoctor_rank_step{{{labels}}} {rank['step']}")
        loss = (rank.get("last_step") or {}).get("loss")
        if isinstance(loss, (int, float)):
            metrics["sddoctor_rank_loss"][1].append(f"sddoctor_rank_loss{{{labels}}} {loss}")
        colls = rank.get("collectives") or {}
        done = colls.get("last_done") or {}
        if isinstance(done.get("seq"), int):
            metrics["sddoctor_rank_last_collective_seq"][1].append(
                f'sddoctor_rank_last_collective_seq{{{labels},pg="{_esc(str(done.get("pg")))}"}} {done["seq"]}'
            )
        inflight = [c for c in colls.get("inflight") or [] if isinstance(c, dict)]
        since = min(
            (c.get("since") for c in inflight if isinstance(c.get("since"), (int, float))), default=None
        )
        seconds = max(0.0, now - since) if since is not None else 0.0
        metrics["sddoctor_rank_collective_inflight_seconds"][1].append(
            f"sddoctor_rank_collective_inflight_seconds{{{labels}}} {seconds:.3f}"
        )
        alive = rank.get("alive")
        if alive is not None:
            metrics["sddoctor_rank_alive"][1].append(f"sddoctor_rank_alive{{{labels}}} {int(bool(alive))}")
    metrics["sddoctor_hang"][1].append(f"sddoctor_hang {int(hang)}")
    metrics["sddoctor_verdicts"][1].append(f"sddoctor_verdicts {len(verdicts)}")
    out = []
    for name, (help_text, samples) in metrics.items():
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        out += samples
    return "\n".join(out) + "\n"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
