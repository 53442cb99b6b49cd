"""Where the main thread stands in the user's code, read from another thread (the heartbeat's
`main_at` in each state snapshot), and how the supervisor reads it back; the user's line of an
exception that library code caught before the program exited."""

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


#: a library's loop that catches what its step raises (here: raises) and hands it to a handler
LIBRARY_LOOP = """
def fit(on_caught):
    try:
        raise KeyboardInterrupt
    except BaseException as exc:
        return on_caught(exc)
"""


def test_an_exception_caught_in_library_code_is_placed_at_the_users_call_into_it() -> None:
    # Lightning catches KeyboardInterrupt in its own frame, then calls sys.exit(1): the exception's
    # traceback starts in that library frame and holds no line of the user's; the user's line is the
    # call into the library (trainer.fit(...)), one of the frames above it
    import sysconfig

    from sddoctor.instrument.exit_hooks import exception_fields

    namespace: dict[str, Any] = {}
    exec(compile(LIBRARY_LOOP, f"{sysconfig.get_paths()['purelib']}/fake_trainer.py", "exec"), namespace)
    fields = namespace["fit"](lambda exc: exception_fields(exc, exc.__traceback__))  # USER_CALL
    line = next(n for n, text in enumerate(open(__file__), start=1) if text.rstrip().endswith("# USER_CALL"))
    assert fields["caller"] == f"{__file__}:{line}", fields
