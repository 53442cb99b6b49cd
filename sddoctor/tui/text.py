"""`sddoctor tui --once`: one snapshot as plain text (like gpustat), no UI started."""

from __future__ import annotations

from sddoctor.ranks.overview import Overview
from sddoctor.ranks.status import images_total
from sddoctor.tui.format import gib, loss, mib, num, pct, rank_label
from sddoctor.tui.paths import short_site, shorten_paths_in


def render_text(ov: Overview) -> str:
    snap = ov.snapshot
    h = snap.host
    lines = []
    load = " ".join(f"{x:.2f}" for x in h.load_average) if h.load_average else "-"
    lines.append(
        f"{h.hostname}  CPU {pct(h.cpu_percent)}  MEM {gib(h.memory_used)}/{gib(h.memory_total)} GiB  load {load}"
        + (f"  driver {snap.driver_version}" if snap.driver_version else "")
    )
    if not snap.nvml_available:
        lines.append(f"no GPU data: {snap.nvml_note}")
    for g in snap.gpus:
        power = f"{num(g.power_draw)}/{num(g.power_limit)} W"
        reasons = ",".join(g.clock_event_reasons) or "none"
        ecc = "n/a" if g.ecc_corrected is None else f"{g.ecc_corrected}/{g.ecc_uncorrected}"
        lines.append(
            f"[{g.index}] {g.name:<20} {pct(g.utilization_gpu):>4} util  {num(g.temperature)}C  "
            f"{gib(g.memory_used)}/{gib(g.memory_total)} GiB  {power}  "
            f"SM {num(g.clock_sm)} MHz MEM {num(g.clock_mem)} MHz  P{num(g.pstate)}  "
            f"clocks: {reasons}  ECC c/u: {ecc}"
        )
        for p in g.processes:
            match = ov.matching.of(g.index, p.pid)
            who = (
                "rank " + rank_label(match.rank.rank, match.rank.local_rank, match.rank.world_size)
                if match
                else "no rank"
            )
            flags = "; ".join(ov.matching.flags(g.index, p.pid))
            lines.append(
                f"      pid {p.pid:<8} {mib(p.gpu_memory):>7} MiB  {who:<16} {p.user or '?':<10} "
                f"CPU {pct(p.cpu_percent):>4}  {(p.command or '?')[:60]}" + (f"  !! {flags}" if flags else "")
            )
    if ov.report.sources:
        total = images_total(ov.report.ranks)
        lines.append(
            f"run: {', '.join(ov.report.sources)}"
            + (f"  all ranks {total:.1f} img/s" if total is not None else "")
        )
    for r in ov.report.ranks:
        lines.append(
            f"  rank {r.rank:<3} {r.node:<20} pid {num(r.pid):<8} GPU {num(r.device):<2} step {num(r.step):<7} "
            f"loss {loss(r.loss):<8} it/s {num(r.it_s, '{:.2f}'):<6} img/s/rank {num(r.images_s, '{:.1f}'):<7} "
            f"{r.state:<12} {shorten_paths_in(r.state_text, ov.report.job_dirs.get(r.node))}"
        )
    for a in ov.alerts:
        job_dir = ov.report.job_dirs.get(a.source or "")
        summary, location = shorten_paths_in(a.summary, job_dir), short_site(a.location, job_dir)
        lines.append(
            f"{a.severity.upper():<7} {summary}"
            + (f" ({location})" if location and location not in summary else "")
        )
    return "\n".join(lines)
