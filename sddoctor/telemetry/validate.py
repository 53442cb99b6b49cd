"""What a reader keeps of a telemetry record: the documented fields with the documented types.

Run directories are read after things went wrong: a rank killed mid-write, a disk that filled
up, a file edited by hand, a newer sddoctor. Readers therefore check each record they hand on:
a known field of the wrong type is dropped (the diagnosis treats it as missing), a record that is
not a JSON object is skipped, unknown fields pass through untouched (newer writers may add
them), and numbers must be finite. What was dropped is noted in `PROBLEMS`, which a command
prints as one warning (`sddoctor report`, `sddoctor tui --once`).

The fields and their types are the TypedDicts of `sddoctor.telemetry.records`; `field_kinds`
turns one into the table this module checks against. Kinds: "int" (not bool), "num" (int or
float, finite, not bool), "str", "bool", "list", "dict", alternatives joined by "|" ("int|str"),
and a trailing "?" where null is allowed ("int?"). The schema is docs/telemetry.md.
"""

from __future__ import annotations

import functools
import math
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from sddoctor.telemetry import records
from sddoctor.telemetry.schema import SCHEMA_VERSION

_SCALARS: dict[Any, str] = {int: "int", float: "num", str: "str", bool: "bool"}


def _kind(hint: Any) -> str:
    """The kind string of one annotation of a record (see the module docstring)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(hint)
        kinds = "|".join(_kind(a) for a in args if a is not type(None))
        return kinds + ("?" if type(None) in args else "")
    if hint in _SCALARS:
        return _SCALARS[hint]
    if hint is list or origin is list:
        return "list"
    if hint is dict or origin is dict or typing.is_typeddict(hint):
        return "dict"
    raise TypeError(f"no JSON kind for the annotation {hint!r}")


@functools.cache
def _hints(record: type) -> dict[str, Any]:
    return typing.get_type_hints(record)


@functools.cache
def field_kinds(record: type) -> dict[str, str]:
    """{field: kind} of a TypedDict of `records`: what `clean` checks each field against."""
    return {name: _kind(hint) for name, hint in _hints(record).items()}


STATE_FIELDS = field_kinds(records.StateSnapshot)
EVENT_FIELDS = field_kinds(records.EventBase)
EVENT_KIND_FIELDS: dict[str, dict[str, str]] = {
    kind: field_kinds(fields) for kind, fields in records.EVENT_KINDS.items()
}
RUN_FIELDS = field_kinds(records.RunRecord)
#: run.json options that must be greater than 0 (the command line refuses anything else)
_POSITIVE_OPTIONS = ("hang_timeout", "startup_timeout", "straggler_ratio")


def _ok(value: Any, kind: str) -> bool:
    for one in kind.split("|"):
        if one.endswith("?"):
            if value is None:
                return True
            one = one[:-1]
        if one == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if (
            one == "num"
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            return True
        if one == "str" and isinstance(value, str):
            return True
        if one == "bool" and isinstance(value, bool):
            return True
        if one == "list" and isinstance(value, list):
            return True
        if one == "dict" and isinstance(value, dict):
            return True
    return False


class Problems:
    """Problems met while reading, by file: each command prints them once, as one warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, dict[str, int]] = {}

    def note(self, source: str, problem: str) -> None:
        with self._lock:
            counts = self._by_source.setdefault(source, {})
            if len(counts) < 20 or problem in counts:
                counts[problem] = counts.get(problem, 0) + 1

    def drain(self) -> list[str]:
        """One line per file and problem ('ranks/rank-00001.jsonl: 3 lines not JSON'); forgets them."""
        with self._lock:
            found, self._by_source = self._by_source, {}
        return [
            f"{source}: {problem}" + (f" (x{n})" if n > 1 else "")
            for source, problems in found.items()
            for problem, n in problems.items()
        ]

    def summary(self) -> str | None:
        """The problems as the one warning a command prints, or None."""
        lines = self.drain()
        if not lines:
            return None
        more = f"; and {len(lines) - 3} more" if len(lines) > 3 else ""
        return "read around garbled telemetry: " + "; ".join(lines[:3]) + more


PROBLEMS = Problems()


def clean(record: Any, fields: Mapping[str, str], source: str) -> dict[str, Any] | None:
    """`record` with its known fields of the wrong type dropped; None when it is not an object."""
    if not isinstance(record, dict):
        PROBLEMS.note(source, "a record that is not a JSON object")
        return None
    out = dict(record)
    for key, kind in fields.items():
        if key in out and not _ok(out[key], kind):
            PROBLEMS.note(source, f"field {key!r} of the wrong type")
            del out[key]
    return out


def _inner(hint: Any) -> Callable[[Any, str], Any] | None:
    """How the value of a field of this annotation is cleaned inside, once its kind is right:
    a nested record field by field, a list of records record by record, a {str: scalar}
    object value by value, a list of strings as strings; None for everything else."""
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(members) == 1:
        hint = members[0]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if typing.is_typeddict(hint):
        return lambda value, source: clean_record(value, hint, source) or {}
    if origin is list and args and typing.is_typeddict(args[0]):
        item = args[0]
        return lambda value, source: [
            r for r in (clean_record(v, item, source) for v in value) if r is not None
        ]
    if origin is list and args == (str,):
        return lambda value, source: [str(v) for v in value]
    if origin is dict and len(args) == 2 and args[1] in _SCALARS:
        kind = _SCALARS[args[1]]
        return lambda value, source: {str(k): v for k, v in value.items() if _ok(v, kind)}
    return None


@functools.cache
def _inners(record: type) -> dict[str, Callable[[Any, str], Any]]:
    return {name: inner for name, hint in _hints(record).items() if (inner := _inner(hint)) is not None}


def clean_record(value: Any, record: type, source: str) -> dict[str, Any] | None:
    """`value` checked against a TypedDict of `records`, nested records included; None when it is
    not an object."""
    out = clean(value, field_kinds(record), source)
    if out is None:
        return None
    for name, inner in _inners(record).items():
        if out.get(name) is not None:
            out[name] = inner(out[name], source)
    return out


def clean_state(snapshot: Any, source: str) -> dict[str, Any] | None:
    """A rank's state snapshot (`ranks/rank-NNNNN.state`) fit for the readers."""
    out = clean_record(snapshot, records.StateSnapshot, source)
    if out is not None:
        _check_version(out, source)
    return out


def clean_event(event: Any, source: str) -> dict[str, Any] | None:
    """One event of `ranks/rank-NNNNN.jsonl` fit for the readers (None: skip it)."""
    out = clean(event, EVENT_FIELDS, source)
    if out is None:
        return None
    _check_version(out, source)
    fields = records.EVENT_KINDS.get(str(out.get("kind")))
    if fields is not None:
        out = clean_record(out, fields, source) or {}
    return out


def clean_run_info(info: Any, source: str = "run.json") -> dict[str, Any]:
    """run.json fit for the readers ({} when it is not an object)."""
    out = clean_record(info, records.RunRecord, source) or {}
    options = out.get("options")
    if isinstance(options, dict):
        for key in _POSITIVE_OPTIONS:
            if key in options and options[key] <= 0:
                PROBLEMS.note(source, f"options.{key} is not positive")
                del options[key]
    return out


def _check_version(record: dict[str, Any], source: str) -> None:
    v = record.get("v")
    if isinstance(v, int) and v > SCHEMA_VERSION:
        PROBLEMS.note(source, f"written by a newer sddoctor (schema v{v}; this one reads v{SCHEMA_VERSION})")
