"""A `Finding` is one thing check-nccl learned: what, how bad, the evidence and what to do.

Severity order: ok < info < warn < fail. The exit code of `sddoctor check-nccl` is the worst
severity: 0 (ok/info), 1 (warn), 2 (fail).
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("ok", "info", "warn", "fail")
_RANK = {name: i for i, name in enumerate(SEVERITIES)}

EXIT_OK = 0
# The same numbers as every sddoctor command (sddoctor/exitcodes.py, docs/exit-codes.md).
EXIT_WARN = 3
EXIT_FAIL = 1


@dataclass
class Finding:
    id: str
    severity: str  # one of SEVERITIES
    title: str
    evidence: list[str] = field(default_factory=list)
    remedy: str = ""

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity {self.severity!r} is not one of {SEVERITIES}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Worst first; within a severity, in the order the checks produced them."""
    return sorted(findings, key=lambda f: -_RANK[f.severity])


def worst_severity(findings: Iterable[Finding]) -> str:
    return max((f.severity for f in findings), key=_RANK.__getitem__, default="ok")


def exit_code(findings: Iterable[Finding]) -> int:
    worst = worst_severity(findings)
    return EXIT_FAIL if worst == "fail" else EXIT_WARN if worst == "warn" else EXIT_OK


def format_findings(
    findings: Iterable[Finding], *, min_severity: str = "ok", width: int | None = None, color: bool = False
) -> str:
    """The findings as a table, worst first, each with its evidence and remedy below it."""
    items = [f for f in sort_findings(findings) if _RANK[f.severity] >= _RANK[min_severity]]
    if not items:
        return "no findings\n"
    width = width or min(shutil.get_terminal_size((110, 24)).columns, 140)
    id_w = max(len("ID"), *(len(f.id) for f in items))
    head = f"{'SEVERITY':<8}  {'ID':<{id_w}}  FINDING"
    indent = " " * (8 + 2 + id_w + 2)
    body_w = max(40, width - len(indent))
    lines = [head, "-" * min(width, len(head) + 60)]
    colors = {"fail": "\033[31;1m", "warn": "\033[33;1m", "info": "\033[36m", "ok": "\033[32m"}
    for f in items:
        sev = f.severity.upper()
        sev_text = f"{colors[f.severity]}{sev:<8}\033[0m" if color else f"{sev:<8}"
        title = textwrap.wrap(f.title, body_w) or [""]
        lines.append(f"{sev_text}  {f.id:<{id_w}}  {title[0]}")
        lines.extend(indent + t for t in title[1:])
        for ev in f.evidence:
            for i, part in enumerate(textwrap.wrap(ev, body_w - 2) or [""]):
                lines.append(indent + ("- " if i == 0 else "  ") + part)
        if f.remedy and f.severity in ("warn", "fail", "info"):
            for i, part in enumerate(textwrap.wrap(f.remedy, body_w - 5)):
                lines.append(indent + ("fix: " if i == 0 else "     ") + part)
    counts = {s: sum(1 for f in items if f.severity == s) for s in reversed(SEVERITIES)}
    lines.append("")
    lines.append("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines) + "\n"
