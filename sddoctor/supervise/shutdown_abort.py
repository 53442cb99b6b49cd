"""A rank that finished its program and then died of a fatal signal on the way out.

The rank's own `exit` event says its program ended cleanly (status ok) and the launcher or the
wait status says that the process then died of SIGABRT or SIGSEGV: the death came from the
interpreter's shutdown, not from a line of the training. The usual cause is a C++ thread that still
holds Python objects when Python is gone: gloo's or NCCL's worker dropping a future's Python
callback (a comm hook's `then`), a process group never destroyed, whose work objects go at exit.
Taking the GIL there ends that thread inside C++, which aborts the process with "terminate called
without an active exception". Its last collective is then not where it died, so the verdict says
"after its program had ended" instead of pointing at it.
"""

from __future__ import annotations

from typing import Any

from sddoctor.supervise.diagnose_base import STOP_SIGNALS

#: what a C++ std::terminate prints when a thread is ended inside C++ (the GIL taken at shutdown)
TERMINATE_TEXT = "terminate called without an active exception"

CLAUSE = (
    " after its program had ended (its exit was recorded as clean), in the interpreter's shutdown: "
    "the training itself completed on this rank"
)

ADVICE = (
    "a process that ends cleanly and then aborts in the interpreter's shutdown usually has a C++ "
    "thread (gloo's or NCCL's worker) releasing Python objects after Python is gone; call "
    "dist.destroy_process_group() at the end of main() and let the DDP models, Work objects and "
    "futures with Python callbacks (a comm hook's then()) go before the script returns"
)


def died_after_its_end(exit_info: dict[str, Any] | None) -> bool:
    """Whether the rank wrote a clean `exit` event and the process then died of a fatal signal
    (not one of the launcher's stop signals, which end a finished rank that waits at its exit)."""
    info = exit_info or {}
    sig = info.get("signal")
    return info.get("status") == "ok" and isinstance(sig, int) and sig > 0 and sig not in STOP_SIGNALS


def evidence(rank: int, exit_info: dict[str, Any] | None, stderr_tail: list[str]) -> list[str]:
    """The lines that show it: the clean exit event, and C++'s terminate message on stderr."""
    lines = [
        f"rank {rank}'s exit event says its program ended cleanly before the process died of "
        f"signal {(exit_info or {}).get('signal')}"
    ]
    if any(TERMINATE_TEXT in line for line in stderr_tail):
        lines.append(f"the job's stderr has {TERMINATE_TEXT!r}: a C++ thread was ended at the shutdown")
    lines.append(ADVICE)
    return lines
