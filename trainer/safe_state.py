"""Nested training state as JSON plus a safetensors file: nothing read back ever executes code.

A state is a tree of dicts, lists, tuples, None, booleans, numbers, strings and tensors (what
`state_dict()` methods return). `encode(tree)` splits it into a JSON-safe tree and a flat
`{name: tensor}` dict; each tensor is replaced by `{"__tensor__": name}`, where the name is its
path in the tree (`unet/conv_in.weight`, `optimizer/state/0/exp_avg`), so the tensor file reads
on its own with any safetensors reader. Tuples, dicts whose keys are not all strings (an
optimizer's `{0: {...}}`) and non-finite floats get tags too, so `decode` gives back exactly what
was encoded. Anything else (a numpy array, an object) is a `TypeError` at save time: a checkpoint
that cannot be read back must never be written.

`write_safetensors` streams the tensors to disk one at a time (the host never holds a second copy
of the state) and returns the file's size and sha256, computed from the bytes as they are written.
Reading goes through the `safetensors` library, which parses a JSON header and raw bytes only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

TENSOR, TUPLE, ITEMS, FLOAT = "__tensor__", "__tuple__", "__items__", "__float__"
_TAGS = frozenset({TENSOR, TUPLE, ITEMS, FLOAT})

#: torch dtype -> safetensors dtype code (the ones a training state holds).
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_CHUNK = 1 << 24  # bytes per write and hash update of a large tensor


class StateFormatError(ValueError):
    """A JSON tree or tensor file that does not hold a valid state (damaged or crafted)."""


# -- the tree -------------------------------------------------------------------------------


def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-safe tree, {name: tensor}); tensors are referenced by their path in the tree."""
    tensors: dict[str, torch.Tensor] = {}

    def join(path: str, key: Any) -> str:
        return f"{path}/{key}" if path else str(key)

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            name = path or "tensor"
            while name in tensors:  # only if a key itself holds "/" and meets a nested path
                name += "'"
            tensors[name] = node
            return {TENSOR: name}
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {FLOAT: repr(node)}
        if isinstance(node, tuple):
            return {TUPLE: [walk(v, join(path, i)) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, join(path, i)) for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) for k in node) and not _TAGS.intersection(node):
                return {k: walk(v, join(path, k)) for k, v in node.items()}
            return {ITEMS: [[walk(k, ""), walk(v, join(path, k))] for k, v in node.items()]}
        raise TypeError(f"cannot store {type(node).__name__} at {path or 'the top'} in a checkpoint")

    return walk(tree, ""), tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `encode`; StateFormatError when the tree is malformed or names a missing tensor."""

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            raise StateFormatError(f"unexpected JSON value {node!r}")
        if len(node) == 1 and next(iter(node)) in _TAGS:
            tag, value = next(iter(node.items()))
            if tag == TENSOR:
                if not isinstance(value, str) or value not in tensors:
                    raise StateFormatError(f"the tensor file has no tensor {value!r}")
                return tensors[value]
            if tag == FLOAT and value in ("nan", "inf", "-inf"):
                return float(value)
            if tag == TUPLE and isinstance(value, list):
                return tuple(walk(v) for v in value)
            if tag == ITEMS and isinstance(value, list) and all(_is_pair(p) for p in value):
                return {_hashable(walk(k)): walk(v) for k, v in value}
            raise StateFormatError(f"malformed {tag} entry")
        return {k: walk(v) for k, v in node.items()}

    return walk(tree)


def _is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise StateFormatError(f"a dict key must be a number, string or tuple, got {key!r}") from None
    return key


# -- files ----------------------------------------------------------------------------------


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """Write a safetensors file tensor by tensor, fsync it; return {"bytes", "sha256"}.

    Device tensors are copied to the host one at a time; nothing else is buffered.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which a checkpoint cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for part in (len(blob).to_bytes(8, "little"), blob):
            fh.write(part)
            digest.update(part)
        for tensor in tensors.values():
            for chunk in _byte_chunks(tensor):
                fh.write(chunk)
                digest.update(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": 8 + len(blob) + offset, "sha256": digest.hexdigest()}


def _byte_chunks(tensor: torch.Tensor) -> Iterable[memoryview]:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return
    raw = flat.view(torch.uint8).numpy().data  # the array's buffer, as memoryview(array) gives it
    for start in range(0, len(raw), _CHUNK):
        yield raw[start : start + _CHUNK]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file (on the host); StateFormatError if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            # Owned copies: tensors backed by the file's memory map would keep a pruned checkpoint's
            # disk space in use for the whole run, and an optimizer could end up updating them in place.
            return {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # the library raises its own error type, OSError or ValueError
        raise StateFormatError(f"{path.name} is not a valid safetensors file ({_first_line(exc)})") from None


def write_json(path: Path, data: Any) -> dict[str, Any]:
    """Write JSON and fsync it; return {"bytes", "sha256"}."""
    raw = json.dumps(data, indent=1, allow_nan=False).encode()
    with open(path, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise StateFormatError(f"{path.name} is not valid JSON ({_first_line(exc)})") from None


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes", "sha256"} of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_digest(path: Path, expected: Any) -> str | None:
    """None when `path` has the recorded size and sha256, else what differs (one phrase)."""
    if not isinstance(expected, dict) or not {"bytes", "sha256"} <= set(expected):
        return f"no size and checksum recorded for {path.name}"
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path.name} is missing"
    if size != expected["bytes"]:
        return f"{path.name} has {size:,} bytes, {expected['bytes']:,} were written"
    if file_digest(path)["sha256"] != expected["sha256"]:
        return f"{path.name} does not match its sha256 (changed or corrupted after it was written)"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
