"""Everything one screen (or one `--json` document) shows: the local GPU snapshot, the ranks,
which process is which rank, and the alerts. `to_dict()` is the documented `--json` schema."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sddoctor.gpu.samples import GpuSnapshot
from sddoctor.gpu.throttle import is_slowdown
from sddoctor.ranks.feeds import RankReport
from sddoctor.ranks.matching import Matching, match_processes
from sddoctor.ranks.status import images_total

JSON_VERSION = 1


@dataclass
class Alert:
    severity: str  # error | warning | info
    kind: str
    summary: str
    culprit_rank: int | None = None
    location: str | None = None
    source: str | None = None


@dataclass
class Overview:
    snapshot: GpuSnapshot
    report: RankReport
    matching: Matching
    alerts: list[Alert] = field(default_factory=list)

    @classmethod
    def build(cls, snapshot: GpuSnapshot, report: RankReport | None = None) -> Overview:
        report = report or RankReport()
        matching = match_processes(snapshot.gpus, report.ranks, snapshot.host.hostname)
        ov = cls(snapshot, report, matching)
        ov.alerts = _alerts(ov)
        return ov

    def to_dict(self) -> dict[str, Any]:
        snap = self.snapshot
        gpus = []
        for g in snap.gpus:
            d = g.to_dict()
            for p in d["processes"]:
                match = self.matching.of(g.index, p["pid"])
                p["rank"] = None
                if match is not None:
                    r = match.rank
                    p["rank"] = {
                        "rank": r.rank,
                        "local_rank": r.local_rank,
                        "world_size": r.world_size,
                        "node": r.node,
                        "matched_by": match.how,
                    }
                p["flags"] = self.matching.flags(g.index, p["pid"])
            gpus.append(d)
        return {
            "v": JSON_VERSION,
            "t": snap.t,
            "host": snap.host.to_dict(),
            "nvml": {
                "available": snap.nvml_available,
                "note": snap.nvml_note,
                "driver_version": snap.driver_version,
            },
            "gpus": gpus,
            "run": {
                "sources": self.report.sources,
                "errors": self.report.errors,
                "images_s_total": images_total(self.report.ranks),
            },
            "ranks": [r.to_dict() for r in self.report.ranks],
            "alerts": [asdict(a) for a in self.alerts],
            "sample_seconds": snap.sample_seconds,
        }


_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def _alerts(ov: Overview) -> list[Alert]:
    out: list[Alert] = []
    snap = ov.snapshot
    for v in ov.report.verdicts:
        out.append(
            Alert(
                severity=str(v.get("severity", "info")),
                kind=str(v.get("kind", "verdict")),
                summary=str(v.get("summary", "")),
                culprit_rank=v.get("culprit_rank"),
                location=v.get("location"),
                source=v.get("source"),
            )
        )
    named = {v.get("culprit_rank") for v in ov.report.verdicts}
    for r in ov.report.ranks:
        if r.rank in named:
            continue  # the verdict says it better
        if r.state in ("crashed", "hung"):
            out.append(
                Alert(
                    "error", f"rank.{r.state}", f"rank {r.rank}: {r.state_text}", r.rank, r.call_site, r.node
                )
            )
        elif r.state == "silent":
            out.append(
                Alert("warning", "rank.silent", f"rank {r.rank}: {r.state_text}", r.rank, None, r.node)
            )
        elif r.state == "oom-fallback":
            out.append(
                Alert("info", "rank.oom_fallback", f"rank {r.rank}: {r.state_text}", r.rank, None, r.node)
            )
    for r, g, used in ov.matching.wrong_gpu:
        amount = f"{used / 2**30:.1f} GiB" if used else "memory"
        out.append(
            Alert(
                "warning",
                "rank.wrong_gpu",
                f"rank {r.rank} (pid {r.pid}) holds {amount} on GPU {g.index}, but its device is GPU {r.device}: "
                "call torch.cuda.set_device(local_rank) before any CUDA work",
                r.rank,
                None,
                r.node,
            )
        )
    if not snap.nvml_available:
        out.append(Alert("info", "gpu.none", f"no GPU data: {snap.nvml_note}; showing host and rank data"))
    for g in snap.gpus:
        if is_slowdown(g.clock_event_mask):
            thermal_or_hw = (g.clock_event_mask or 0) & (0x008 | 0x020 | 0x040 | 0x080)
            out.append(
                Alert(
                    "warning" if thermal_or_hw else "info",
                    "gpu.clocks",
                    f"GPU {g.index} clocks held back: {', '.join(g.clock_event_reasons)}",
                )
            )
        if g.ecc_uncorrected:
            out.append(
                Alert("error", "gpu.ecc", f"GPU {g.index}: {g.ecc_uncorrected} uncorrected ECC errors")
            )
    for err in ov.report.errors:
        out.append(Alert("warning", "source.error", err))
    out.sort(key=lambda a: _SEVERITY_ORDER.get(a.severity, 3))
    return out
