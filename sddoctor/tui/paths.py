"""Source paths as a person reads them: relative to the job's folder, library frames by package.

A rank reports the call site of a collective as `co_filename:line`, usually an absolute path
(`/home/alice/proj/train.py:212`, `/opt/venv/lib/python3.11/site-packages/torch/nn/modules/
module.py:1750`). On screen that becomes `train.py:212` and `torch/nn/modules/module.py:1750`,
and where a column is narrow, `torch/…/module.py:1750`: the package and the file stay.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)?t?/")
_SITE = re.compile(r"^(.*?)(:\d+)?$")
#: an absolute path to a Python file inside a text (a stack dump), with its optional :line
_PATH_IN_TEXT = re.compile(r"(/[^\s:()\"',]+\.py)\b")


def short_path(path: str, job_dir: str | None = None) -> str:
    """`path` relative to `job_dir` when it is inside it; a library file from its package on;
    a standard-library file from its module on; a file under the home directory as ~/...;
    anything else unchanged (a relative path already is relative to the job's folder)."""
    if not path.startswith("/"):
        return path
    if job_dir:
        base = job_dir.rstrip("/") + "/"
        if path.startswith(base):
            return path[len(base) :]
    for marker in _LIBRARY_MARKERS:
        cut = path.rfind(marker)
        if cut >= 0:
            return path[cut + len(marker) :]
    stdlib = [m.end() for m in _STDLIB.finditer(path)]
    if stdlib:
        return path[stdlib[-1] :]
    home = _home()
    if home != "//" and path.startswith(home):
        return "~/" + path[len(home) :]
    return path


@lru_cache(maxsize=1)
def _home() -> str:
    return os.path.expanduser("~").rstrip("/") + "/"


def short_site(site: str | None, job_dir: str | None = None) -> str | None:
    """A `file:line` call site with its file shortened by `short_path`."""
    if not site:
        return site
    m = _SITE.match(site)
    assert m is not None  # the pattern matches any string
    return short_path(m.group(1), job_dir) + (m.group(2) or "")


def shorten_paths_in(text: str, job_dir: str | None = None) -> str:
    """Every absolute .py path in `text` (a stack dump) shortened by `short_path`."""
    return _PATH_IN_TEXT.sub(lambda m: short_path(m.group(1), job_dir), text)


def elide_path(site: str, width: int) -> str:
    """`site` in at most `width` cells, cutting whole folders out of the middle:
    torch/nn/parallel/distributed.py:1234 -> torch/…/distributed.py:1234. The file name and
    line stay; where even `first/…/file:line` does not fit, `…/file:line`, and only then is the
    start of the file name cut."""
    if len(site) <= width:
        return site
    parts = site.split("/")
    if len(parts) > 2:
        head, tail = parts[0], parts[1:]
        while len(tail) > 1:
            tail = tail[1:]
            candidate = "/".join([head, "…", *tail])
            if len(candidate) <= width:
                return candidate
    if len(parts) > 1 and len(parts[-1]) + 2 <= width:
        return "…/" + parts[-1]
    return "…" + site[len(site) - width + 1 :] if width > 1 else "…"[:width]
