"""`sddoctor check-nccl`: environment checks and a real collective bandwidth test.

Python entry points (none imports torch at import time):
    run_preflight(quick=True, collective=False) -> list[Finding]
    format_findings(findings) -> str
"""

from sddoctor.preflight.api import run_preflight
from sddoctor.preflight.findings import Finding, format_findings

__all__ = ["Finding", "format_findings", "run_preflight"]
