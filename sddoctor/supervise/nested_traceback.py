"""Tracebacks carried inside an exception's message.

torch re-raises an error of a DataLoader worker in the rank as "Caught ValueError in DataLoader
worker process 1. Original Traceback (most recent call last): ...": the rank's own traceback ends
in torch's `reraise`, and the line that failed (the user's Dataset) is only in the text. The
diagnosis reads it from there to name that line and the original exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$', re.MULTILINE)
_SOURCE = re.compile(
    r"Caught \w+ in (?P<source>DataLoader worker process \d+|pin memory thread[^.]*|multiprocessing worker)"
)
_START = "Traceback (most recent call last):"


@dataclass(frozen=True)
class NestedTraceback:
    source: str  # where it was raised ("DataLoader worker process 1"), "" when the text does not say
    frames: tuple[str, ...]  # "path:line in function", outermost first
    exception: str  # its last line, "ValueError: corrupt image at index 77"


def nested_traceback(message: str) -> NestedTraceback | None:
    """The traceback written inside `message`, or None when it holds none."""
    start = message.find(_START)
    if start < 0:
        return None
    body = message[start:]
    frames = tuple(f"{m['path']}:{m['line']} in {m['func'].strip()}" for m in _FRAME.finditer(body))
    if not frames:
        return None
    # the exception line is the last one that is not indented (source and caret lines are)
    lines = [line for line in body.splitlines()[1:] if line.strip() and not line[0].isspace()]
    found = _SOURCE.search(message[:start])
    return NestedTraceback(found["source"] if found else "", frames, lines[-1].strip() if lines else "")
