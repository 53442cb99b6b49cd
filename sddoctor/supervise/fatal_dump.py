"""The Python stack a rank left when a fatal signal killed it (`ranks/rank-NNNNN.fatal`).

A rank under `sddoctor run` has faulthandler write every thread's stack into that file on SIGSEGV,
SIGABRT, SIGBUS, SIGFPE or SIGILL (`instrument.exit_hooks.enable_fatal_dump`): the only record of
where such a rank was, since no Python code runs there. faulthandler writes, per dump:

    Fatal Python error: Segmentation fault

    Thread 0x00007f31648656c0 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 982 in run
    ...
    Current thread 0x00007f31655ccb80 (most recent call first):
      File "train.py", line 26 in maybe_fault
      File "train.py", line 40 in main

The file is appended to (a restarted rank adds a dump), so the last dump is the one read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HEADER = "Fatal Python error:"
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class FatalDump:
    error: str  # "Segmentation fault"
    frames: tuple[str, ...]  # the crashing thread's frames, 'file:line in func', innermost first

    def to_dict(self) -> dict[str, object]:
        return {"error": self.error, "frames": list(self.frames)}


def parse_fatal_dump(text: str) -> FatalDump | None:
    """The last dump in `text`: its error and the stack of the thread that received the signal
    (faulthandler's "Current thread"). None is marked when the signal struck a thread without
    Python state (a backend's own thread aborting on a collective mismatch): then the last thread
    listed, the main thread (faulthandler lists the newest first), where the program's code runs."""
    start = text.rfind(_HEADER)
    if start < 0:
        return None
    lines = text[start:].splitlines()
    error = lines[0][len(_HEADER) :].strip()
    threads: list[tuple[bool, list[str]]] = []
    for line in lines[1:]:
        if _THREAD.match(line):
            threads.append((line.startswith("Current thread"), []))
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1][1].append(f"{match['path']}:{match['line']} in {match['func'].strip()}")
    chosen = next((frames for current, frames in threads if current), threads[-1][1] if threads else [])
    return FatalDump(error, tuple(chosen))


def read_fatal_dump(path: Path) -> FatalDump | None:
    """The last dump of a rank's fatal-signal file; None when there is none (or it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            if size == 0:
                return None
            fh.seek(max(0, size - _MAX_BYTES))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    return parse_fatal_dump(text)
