"""Where the main thread stands in the user's code, read from another thread (the heartbeat's
`main_at` in each state snapshot), and how the supervisor reads it back."""

from __future__ import annotations

import threading
import time
from typing import Any

from sddoctor.instrument.position import main_thread_position
from sddoctor.telemetry.snapshot import RankSnapshot

WAIT_LINE = next(n for n, text in enumerate(open(__file__), start=1) if text.rstrip().endswith("# WAIT_HERE"))


def _wait_in_user_code(release: threading.Event) -> None:
    release.wait(10)  # WAIT_HERE


def test_the_main_threads_innermost_user_line_is_read_from_another_thread() -> None:
    # the main thread waits inside threading's own code; the position is this file's line that
    # called it, in the function that did
    seen: dict[str, Any] = {}
    release = threading.Event()

    def reader() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen["position"] = main_thread_position()
            if seen["position"] == {"at": f"{__file__}:{WAIT_LINE}", "function": "_wait_in_user_code"}:
                break
            time.sleep(0.01)
        release.set()

    thread = threading.Thread(target=reader)
    thread.start()
    _wait_in_user_code(release)
    thread.join()
    assert seen["position"] == {"at": f"{__file__}:{WAIT_LINE}", "function": "_wait_in_user_code"}


def test_a_snapshot_reads_main_at_and_ignores_a_malformed_one() -> None:
    snap = RankSnapshot.of({"main_at": {"at": "/src/train.py:40", "function": "main"}})
    assert (snap.main_at, snap.main_function) == ("/src/train.py:40", "main")
    for bad in ([1, 2], "train.py:40", {"at": 40}, None):
        assert RankSnapshot.of({"main_at": bad}).main_at is None
