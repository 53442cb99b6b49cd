"""The state endpoint of `sddoctor run`: GET /api/state (JSON) and GET /metrics (Prometheus text).

A stdlib `ThreadingHTTPServer` in a daemon thread. It serves a snapshot that the supervisor
loop publishes once a second, so a slow client never touches the watcher's data.

Built for shared networks, not only for the loopback interface:

- A non-loopback address needs a bearer token (`Authorization: Bearer <token>`) unless the
  operator says `--insecure`; `endpoint_token` takes it from --token-file or SDDOCTOR_TOKEN, or
  makes one and stores it in RUN_DIR/endpoint.token (mode 0600). Every route then needs it,
  /metrics included (Prometheus: `authorization: {credentials_file: ...}`).
- Without a token (the loopback default) the Host header must name this machine's loopback
  (`localhost`, `127.0.0.1`, `[::1]`), which stops a web page from reading the state through DNS
  rebinding.
- Each connection carries one request (HTTP/1.0): reading it must finish within `IDLE_TIMEOUT`
  per read and `REQUEST_DEADLINE` in all, and request line plus headers within
  `MAX_REQUEST_BYTES`; a body is refused. A reaper thread closes connections past their deadline,
  so a client that connects and sends nothing, or drips a byte at a time, holds a worker for
  seconds, not forever; `MAX_CLIENTS` connections at once (`MAX_PER_CLIENT` per address) keep a
  flood from starving the others.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sddoctor.telemetry.redact import redact_argv

StateProvider = Callable[[], dict[str, Any]]
#: accept header -> (body, content type)
MetricsProvider = Callable[[str], tuple[bytes, str]]

#: The default port of the endpoint: fixed so that Prometheus can be told where to scrape, and
#: outside both Prometheus' exporter range (9100-9999, all allocated) and the ports of the usual
#: training tools (TensorBoard 6006, torchrun 29500, Ray 8265, Jupyter 8888).
DEFAULT_PORT = 8765
TOKEN_ENV = "SDDOCTOR_TOKEN"
TOKEN_FILE = "endpoint.token"
IDLE_TIMEOUT = 5.0
REQUEST_DEADLINE = 10.0
MAX_REQUEST_BYTES = 16 * 1024
MAX_CLIENTS = 64
MAX_PER_CLIENT = 16
STATE_SCHEMA = "sddoctor.state/1"


class EndpointError(Exception):
    """The endpoint cannot start as asked; the message says why and what to do."""


class PortInUse(EndpointError):
    pass


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine's loopback."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_token(
    run_dir: Path, token_file: str | None = None, environ: dict[str, str] | None = None
) -> tuple[str, bool]:
    """(token, generated). From `token_file`, else $SDDOCTOR_TOKEN, else a new random one; it is
    stored in RUN_DIR/endpoint.token with mode 0600 in every case, so that a local client
    (`sddoctor tui`) or Prometheus on this node can read it. Raises EndpointError."""
    env = os.environ if environ is None else environ
    generated = False
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise EndpointError(f"--token-file {token_file}: cannot read it ({exc})") from None
        if not token:
            raise EndpointError(f"--token-file {token_file} is empty; put the token on its first line")
    elif env.get(TOKEN_ENV, "").strip():
        token = env[TOKEN_ENV].strip()
    else:
        token, generated = secrets.token_urlsafe(32), True
    if len(token) < 16 or any(c.isspace() for c in token):
        raise EndpointError("the endpoint token must be at least 16 characters without spaces")
    path = run_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(token + "\n")
    except OSError as exc:
        raise EndpointError(f"cannot store the endpoint token in {path}: {exc}") from None
    return token, generated


def read_token_file(run_dir: str | os.PathLike[str]) -> str | None:
    """The token a run stored (for clients on the same machine), or None."""
    try:
        return (Path(run_dir) / TOKEN_FILE).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def get_state(url: str, token: str | None = None, timeout: float = 2.0) -> dict[str, Any]:
    """GET `url`/api/state of another supervisor (`--peers`). Raises OSError or ValueError."""
    base = url if url.startswith("http") else f"http://{url}"
    request = urllib.request.Request(f"{base.rstrip('/')}/api/state")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        data = json.loads(resp.read(64 << 20))
    if not isinstance(data, dict):
        raise ValueError(f"{base}/api/state did not return a JSON object")
    return data


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stopping must not wait for a client that sends nothing
    allow_reuse_address = True  # a port left in TIME_WAIT by the last run is free to take

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        host = address[0]
        if ":" in host.strip("[]"):
            self.address_family = socket.AF_INET6
        self._lock = threading.Lock()
        self._clients: dict[str, int] = {}
        self._deadlines: dict[socket.socket, float] = {}
        self._closing = threading.Event()
        super().__init__((host.strip("[]"), address[1]), handler)
        self._reaper = threading.Thread(target=self._reap, name="sddoctor-http-reaper", daemon=True)
        self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        ip = str(client_address[0])
        with self._lock:
            total = sum(self._clients.values())
            if total >= MAX_CLIENTS or self._clients.get(ip, 0) >= MAX_PER_CLIENT:
                self.shutdown_request(request)  # too many at once: this one is closed, not queued
                return
            self._clients[ip] = self._clients.get(ip, 0) + 1
            self._deadlines[request] = time.monotonic() + REQUEST_DEADLINE
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(request, ip)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request, str(client_address[0]))

    def _release(self, request: Any, ip: str) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
            left = self._clients.get(ip, 1) - 1
            if left > 0:
                self._clients[ip] = left
            else:
                self._clients.pop(ip, None)

    def _reap(self) -> None:
        """Close connections past their deadline (a slow-drip client resets no timeout here)."""
        while not self._closing.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._deadlines.items() if t < now]
                for s in late:
                    self._deadlines.pop(s, None)
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (or was cut off) is not news for the job's terminal

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()


class StateServer:
    """The endpoint. `bind()` happens in the constructor (so a taken port is known before any
    launch); `start()` begins serving."""

    def __init__(
        self,
        provider: StateProvider | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        metrics: MetricsProvider | None = None,
    ) -> None:
        self.provider: StateProvider = provider or (lambda: {})
        self.metrics = metrics
        self.token = token
        self.host = host
        try:
            self.httpd = _Server((host, port), _make_handler(self))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"port {port} on {host} is taken (another sddoctor run on this host?)"
                ) from None
            raise EndpointError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="sddoctor-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        address = self.httpd.server_address[0]
        host = address.decode() if isinstance(address, bytes) else str(address)
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()  # what another machine can reach
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(
        self, provider: StateProvider | None = None, metrics: MetricsProvider | None = None
    ) -> StateServer:
        if provider is not None:
            self.provider = provider
        if metrics is not None:
            self.metrics = metrics
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)


def open_endpoint(
    host: str, port: int, *, explicit: bool, token: str | None
) -> tuple[StateServer, str | None]:
    """Bind the endpoint for `sddoctor run`: (server, a note for the operator or None).

    The default port taken (a second run on this host) falls back to any free port with a note;
    a port the operator chose that is taken raises PortInUse."""
    try:
        return StateServer(host=host, port=port, token=token), None
    except PortInUse:
        if explicit:
            raise
    server = StateServer(host=host, port=0, token=token)
    note = (
        f"port {port} is taken (another sddoctor run on this host?); the endpoint is on port "
        f"{server.port} instead (--port N picks one, --port 0 any free port, --port -1 none)"
    )
    return server, note


def _allowed_host(header: str | None) -> bool:
    if not header:
        return True  # HTTP/1.0 clients may send none
    host = header.strip()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    else:
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return is_loopback(host)


def _redacted_state(state: dict[str, Any]) -> dict[str, Any]:
    """The served state with secrets out of the command line (run.json is written redacted;
    this keeps a state assembled elsewhere from leaking one)."""
    run = state.get("run")
    if isinstance(run, dict) and isinstance(run.get("command"), list):
        state = dict(state, run=dict(run, command=redact_argv(run["command"])))
    return {"schema": STATE_SCHEMA, **state}


class _Handler(BaseHTTPRequestHandler):
    """One request to the endpoint (`_make_handler` binds the class to its `StateServer`)."""

    endpoint: StateServer
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive
    server_version = "sddoctor"
    sys_version = ""
    timeout = IDLE_TIMEOUT  # every read and write of the socket
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s: %(explain)s\n"

    def setup(self) -> None:
        super().setup()
        self.rfile = _Budget(self.rfile, MAX_REQUEST_BYTES)  # type: ignore[assignment]

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.rfile.exhausted:  # type: ignore[attr-defined]
            self.send_error(
                431, "Request too large", f"request line and headers over {MAX_REQUEST_BYTES} bytes"
            )
            return False
        if self.headers.get("Transfer-Encoding") or (self.headers.get("Content-Length") or "0") != "0":
            self.send_error(413, "No body accepted", "this endpoint serves GET requests only")
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._serve(head=False)

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
        self._serve(head=True)

    def _authorized(self) -> bool:
        if self.endpoint.token is None:
            if _allowed_host(self.headers.get("Host")):
                return True
            self._send(403, "text/plain", b"forbidden: Host is not this machine's loopback\n", False)
            return False
        given = self.headers.get("Authorization") or ""
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), self.endpoint.token.encode()
        ):
            return True
        self._send(
            401,
            "text/plain",
            b"unauthorized: send 'Authorization: Bearer <token>' (the token is in RUN_DIR/endpoint.token)\n",
            False,
            extra={"WWW-Authenticate": 'Bearer realm="sddoctor"'},
        )
        return False

    def _serve(self, head: bool) -> None:
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/api/state":
            body = json.dumps(_redacted_state(self.endpoint.provider()), default=str).encode()
            self._send(200, "application/json", body, head)
        elif path == "/metrics" and self.endpoint.metrics is not None:
            body, ctype = self.endpoint.metrics(self.headers.get("Accept") or "")
            self._send(200, ctype, body, head)
        elif path == "":
            self._send(200, "text/plain", b"sddoctor run: GET /api/state or /metrics\n", head)
        else:
            self._send(404, "text/plain", b"not found: try /api/state or /metrics\n", head)

    def _send(
        self, code: int, ctype: str, body: bytes, head: bool, extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the job's terminal is not ours to fill


def _make_handler(server: StateServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        endpoint = server

    return Handler


class _Budget:
    """A reader that hands out at most `limit` bytes in all (request line and headers)."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw = raw
        self._left = limit
        self.exhausted = False

    def readline(self, size: int = -1) -> bytes:
        if self._left <= 0:
            self.exhausted = True
            return b""
        n = self._left if size is None or size < 0 else min(size, self._left)
        line = self._raw.readline(n)
        self._left -= len(line)
        if self._left <= 0 and not line.endswith(b"\n"):
            self.exhausted = True
        return line

    def read(self, size: int = -1) -> bytes:
        return b""  # no body is ever read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)
