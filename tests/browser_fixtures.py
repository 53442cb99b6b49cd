"""A real headless Chromium for the report tests, driven by Playwright.

The browser is Debian's `chromium` package (scripts/test.sh installs it in CI); Playwright's own
browser download is not used. `chromium_or_skip()` skips with the reason when either is missing,
so a machine without them says why instead of passing silently.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("SDDOCTOR_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def chromium_or_skip() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no Chromium: install Debian's package (apt-get install chromium; scripts/test.sh does in CI)"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright is not installed: pip install -e '.[dev]'")
    return path


@contextmanager
def browser_page(width: int = 1400, height: int = 900) -> Iterator[tuple[Any, list[tuple[str, str]]]]:
    """A fresh page and the list its console messages and page errors are collected into."""
    from playwright.sync_api import sync_playwright

    path = chromium_or_skip()
    messages: list[tuple[str, str]] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: messages.append((m.type, m.text)))
            page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
            yield page, messages
        finally:
            browser.close()


@contextmanager
def serve(directory: Path, extra: dict[str, bytes] | None = None) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 for `directory`; paths ending in a key of `extra` get that body."""
    extra = extra or {}

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            for suffix, body in extra.items():
                if self.path.split("?")[0].endswith(suffix):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
            super().do_GET()

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(directory))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
