"""`sddoctor check-nccl`: environment checks and a real collective bandwidth test.

Python entry points (none imports torch at import time):
    run_preflight(quick=True, collective=False) -> list[Finding]
    format_findings(findings) -> str

They are loaded on first use, so the test's worker processes (`python -m
sddoctor.preflight.bandwidth`) do not import the checks when the package is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Finding", "format_findings", "run_preflight"]


def __getattr__(name: str) -> Any:
    if name == "run_preflight":
        from sddoctor.preflight.api import run_preflight

        return run_preflight
    if name in ("Finding", "format_findings"):
        from sddoctor.preflight import findings

        return getattr(findings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
