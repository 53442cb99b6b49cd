"""Which source files are the user's own code, decided by where libraries are really installed.

A verdict points at the first frame of the user's own code: the launched script, its neighbours, a
package of the user's. Everything under an install location of the interpreter (the standard library,
every site-packages or dist-packages folder on sys.path, the scheme paths of sysconfig), torch's and
sddoctor's own package folders is library code. The decision is made on real folders, never on
substrings of a path, so a project cloned into a folder named `sddoctor` or kept under a path with
`lib/python3` in it is still the user's code.

A rank reports its roots in its `start` event (`code_roots`), because the supervisor may run in
another environment than the job; `CodeRoots.from_dict` rebuilds them there. Standard library only.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: "scripts": the console scripts pip installs (torchrun, accelerate), whose frames are a launcher's
_SCHEME_KEYS = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _folder(path: str) -> str | None:
    """`path` made absolute and normalised, with a trailing separator (None if empty)."""
    if not path:
        return None
    return os.path.join(os.path.normpath(os.path.abspath(path)), "")


def _variants(path: str) -> set[str]:
    """The folder as written and with symlinks resolved (co_filename keeps the path as imported)."""
    out = {_folder(path), _folder(os.path.realpath(path)) if path else None}
    return {p for p in out if p}


@dataclass(frozen=True)
class CodeRoots:
    """Folders whose files are library code; everything else (but pseudo files) is the user's."""

    library: tuple[str, ...]
    #: folders of the runtime itself (torch, sddoctor): skipped even when looking for any caller
    internal: tuple[str, ...] = field(default=())

    @classmethod
    def current(cls, internal_modules: Iterable[str] = ("torch", "sddoctor")) -> CodeRoots:
        """The roots of the running interpreter, with the packages named in `internal_modules`."""
        library: set[str] = set()
        for key in _SCHEME_KEYS:
            try:
                library |= _variants(sysconfig.get_path(key))
            except (KeyError, ValueError):
                pass
        try:
            library |= {v for p in site.getsitepackages() for v in _variants(p)}
        except AttributeError:  # some embedded or virtualenv builds lack it
            pass
        user_site = getattr(site, "USER_SITE", None)
        if user_site:
            library |= _variants(user_site)
        for entry in sys.path:  # e.g. the system site-packages of a venv, another env on PYTHONPATH
            if os.path.basename(os.path.normpath(entry or ".")) in _PACKAGE_DIRS:
                library |= _variants(entry)
        internal: set[str] = set()
        for name in internal_modules:
            folder = _module_folder(name)
            if folder:
                internal |= _variants(folder)
        return cls(tuple(sorted(library | internal)), tuple(sorted(internal)))

    @classmethod
    def from_dict(cls, data: Any) -> CodeRoots | None:
        """Roots as a rank reported them (`to_dict`), or None if `data` is not such a record."""
        if not isinstance(data, dict):
            return None
        library = data.get("library")
        internal = data.get("internal") or []
        if not isinstance(library, list) or not isinstance(internal, list):
            return None
        clean = [p for p in library if isinstance(p, str) and p]
        inner = [p for p in internal if isinstance(p, str) and p]
        return cls(
            tuple(sorted({_folder(p) or p for p in clean})), tuple(sorted({_folder(p) or p for p in inner}))
        )

    def to_dict(self) -> dict[str, list[str]]:
        return {"library": list(self.library), "internal": list(self.internal)}

    def merged(self, other: CodeRoots | None) -> CodeRoots:
        if other is None:
            return self
        return CodeRoots(
            tuple(sorted(set(self.library) | set(other.library))),
            tuple(sorted(set(self.internal) | set(other.internal))),
        )

    def is_library(self, filename: str) -> bool:
        """True for library code and pseudo files (`<frozen runpy>`, `<string>`)."""
        if not filename or filename.startswith("<"):
            return True
        path = os.path.normpath(os.path.abspath(filename))
        return path.startswith(self.library)

    def is_internal(self, filename: str) -> bool:
        """True for torch's and sddoctor's own files (and pseudo files)."""
        if not filename or filename.startswith("<"):
            return True
        return os.path.normpath(os.path.abspath(filename)).startswith(self.internal)

    def is_user(self, filename: str) -> bool:
        return not self.is_library(filename)


def _module_folder(name: str) -> str | None:
    """The folder of an importable package, without importing it."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if module is not None else None
    if path is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    return os.path.dirname(os.path.abspath(path)) if path else None


_current: CodeRoots | None = None


def current_roots() -> CodeRoots:
    """`CodeRoots.current()`, computed once per process."""
    global _current
    if _current is None:
        _current = CodeRoots.current()
    return _current


def frame_path(frame_text: str) -> str:
    """The path of a 'file:line in func' or 'file:line' frame text."""
    location = frame_text.split(" in ", 1)[0].strip()
    path, sep, line = location.rpartition(":")
    return path if sep and line.strip().isdigit() else location


def first_user_frame(
    frames: Iterable[str], roots: CodeRoots | None = None, innermost_first: bool = False
) -> str | None:
    """The innermost frame text of the user's code among `frames` (outermost first unless
    `innermost_first`), else None."""
    roots = roots or current_roots()
    ordered = list(frames) if innermost_first else list(reversed(list(frames)))
    for text in ordered:
        if isinstance(text, str) and roots.is_user(frame_path(text)):
            return text
    return None
