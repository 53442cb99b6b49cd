"""The health summary of a run (report.json's `health`, report.md's "Health" section).

What a person wants to read after a run that went well, and the baseline to compare a bad one
with: throughput, step time p50/p95 per rank, the share of wall time each rank spent inside
collectives and how much of it was waiting for a later rank, memory peaks, OOM fallbacks, and
the communication settings in effect. Built from the run directory's events, the collective
timeline (`sddoctor.supervise.timeline`) and the supervisor's GPU samples (`gpulog`); every
figure is None where its source is missing. Pure functions over loaded data; no torch.
"""

from __future__ import annotations

import statistics
from typing import Any

from sddoctor.supervise.timeline import Timeline, lane_stats
from sddoctor.telemetry import RankView, RunView, StepRecord


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def health_summary(
    view: RunView, timeline: Timeline | None, gpu_samples: list[dict[str, Any]]
) -> dict[str, Any]:
    # A restarted job (torchrun --max-restarts) is summed up by its last attempt, as its collectives
    # are matched within one attempt: the steps of a process that was replaced, and the time the
    # launcher took to restart, belong to no rate of the run that went on.
    attempts = {r: rv.attempts() for r, rv in view.ranks.items()}
    ranks = {str(r): _rank_health(parts, timeline) for r, parts in sorted(attempts.items())}
    return {
        "throughput": _throughput({r: parts[-1] for r, parts in attempts.items()}),
        "ranks": ranks,
        "oom": _oom(view),
        "comm": _comm(view),
        "gpus": _gpus(gpu_samples),
    }


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def step_times(rv: RankView) -> list[float]:
    """Seconds per step: the step events' `step_time`, else the gaps between consecutive step events."""
    steps = [StepRecord.of(e) for e in rv.of_kind("step")]
    times = [t for s in steps if (t := s.step_time) is not None and t >= 0]
    if times:
        return times
    ends = [t for s in steps if (t := s.ended) is not None]
    return [b - a for a, b in zip(ends, ends[1:], strict=False) if b >= a]


def _rank_health(attempts: list[RankView], timeline: Timeline | None) -> dict[str, Any]:
    """The figures of the rank's last attempt (its only one unless the launcher restarted it)."""
    rv = attempts[-1]
    times = step_times(rv)
    start = rv.last("start") or {}
    events_t = [t for e in rv.events if (t := _num(e.get("t"))) is not None]
    wall = (max(events_t) - min(events_t)) if len(events_t) > 1 else None
    summary = rv.last("collective") or {}
    snapshot = rv.snapshot
    # the summary event is written every 10 s and at exit, the snapshot every second: take the later
    found = [s for s in (_num(summary.get("seconds")), snapshot.total_seconds) if s is not None]
    coll_seconds = max(found) if found else None
    peaks = [p for e in rv.of_kind("step") if (p := StepRecord.of(e).mem_peak) is not None]
    out: dict[str, Any] = {
        "host": start.get("host") or snapshot.host,
        "device": snapshot.device or start.get("device"),
        "steps": len(rv.of_kind("step")),
        "step_time_p50": _round(percentile(times, 50)),
        "step_time_p95": _round(percentile(times, 95)),
        "step_time_max": _round(max(times)) if times else None,
        "wall_seconds": _round(wall, 3),
        "collective_seconds": _round(coll_seconds),
        "collective_share": _round(coll_seconds / wall) if coll_seconds is not None and wall else None,
        "ddp_bucket_seconds": _num(summary.get("ddp_bucket_seconds")),
        "mem_peak": int(max(peaks)) if peaks else None,
        "attempts": len(attempts),
        "earlier_steps": sum(len(a.of_kind("step")) for a in attempts[:-1]),
    }
    lane = timeline.lanes.get(rv.rank) if timeline is not None else None
    if lane is not None and lane.calls:
        stats = lane_stats(lane, attempt=len(attempts) - 1)
        out["waited_seconds"] = stats["waited_seconds"]
        out["wait_share"] = _round(stats["waited_seconds"] / wall) if wall else None
        out["arrived_last"] = stats["arrived_last"]
        out["matched_collectives"] = stats["matched"]
    return out


def _throughput(ranks: dict[int, RankView]) -> dict[str, Any]:
    """Global images (samples) per second over the steps, and the steps' own median figure."""
    total = 0.0
    first: float | None = None
    last: float | None = None
    reported: list[float] = []
    steps = 0
    for rv in ranks.values():
        events = rv.of_kind("step")
        steps = max(steps, len(events))
        for e in events:
            step = StepRecord.of(e)
            total += step.samples or 0.0
            end = step.ended
            length = step.step_time or 0.0
            if end is not None:
                first = end - length if first is None else min(first, end - length)
                last = end if last is None else max(last, end)
            if rv.rank == min(ranks) and (ips := step.images_per_s) is not None:
                reported.append(ips)
    window = (last - first) if first is not None and last is not None else None
    return {
        "steps": steps,
        "samples": int(total),
        "window_seconds": _round(window, 3),
        "images_per_s": _round(total / window, 3) if window and total else None,
        "images_per_s_median": _round(statistics.median(reported), 3) if reported else None,
    }


def _oom(view: RunView) -> dict[str, Any]:
    ooms = [dict(e) for rv in view.ranks.values() for e in rv.of_kind("oom")]
    fallbacks: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rv in view.ranks.values():
        for e in rv.of_kind("fallback"):  # every rank logs the same agreed fallback: keep one
            key = (e.get("step"), e.get("new_micro_batch"), e.get("new_grad_accum"))
            fallbacks.setdefault(key, {k: v for k, v in e.items() if k not in ("v", "kind", "rank")})
    return {
        "events": len(ooms),
        "ranks": sorted({int(e["rank"]) for e in ooms if isinstance(e.get("rank"), int)}),
        "fallbacks": sorted(fallbacks.values(), key=lambda f: f.get("t") or 0),
    }


def _comm(view: RunView) -> dict[str, Any]:
    """The communication settings the ranks started with: those all ranks share, and the differences."""
    envs: dict[int, dict[str, str]] = {}
    backends: set[str] = set()
    for rank, rv in view.ranks.items():
        start = rv.last("start") or {}
        if isinstance(start.get("comm_env"), dict):
            envs[rank] = {str(k): str(v) for k, v in start["comm_env"].items()}
        backend = (rv.state or {}).get("backend") or start.get("backend")
        if backend:
            backends.add(str(backend))
    out: dict[str, Any] = {"backend": ", ".join(sorted(backends)) or None, "recorded": bool(envs)}
    if not envs:
        return out
    names = sorted({n for env in envs.values() for n in env})
    common = {n: envs[min(envs)][n] for n in names if len({env.get(n) for env in envs.values()}) == 1}
    out["env"] = common
    out["differ"] = {
        n: {str(r): env.get(n) for r, env in sorted(envs.items())} for n in names if n not in common
    }
    return out


def _gpus(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per GPU (host:index): mean and max utilisation, peak memory in use, from the GPU samples."""
    acc: dict[str, dict[str, Any]] = {}
    for line in samples:
        for g in line.get("gpus") or []:
            key = f"{line.get('host')}:{g.get('index')}"
            a = acc.setdefault(
                key, {"name": g.get("name"), "util": [], "mem": [], "mem_total": g.get("mem_total")}
            )
            if (u := _num(g.get("util"))) is not None:
                a["util"].append(u)
            if (m := _num(g.get("mem_used"))) is not None:
                a["mem"].append(m)
    return {
        key: {
            "name": a["name"],
            "samples": max(len(a["util"]), len(a["mem"])),
            "util_mean": _round(statistics.fmean(a["util"]), 1) if a["util"] else None,
            "util_max": max(a["util"]) if a["util"] else None,
            "mem_peak": int(max(a["mem"])) if a["mem"] else None,
            "mem_total": a["mem_total"],
        }
        for key, a in sorted(acc.items())
    }


# -- text -------------------------------------------------------------------------------------------


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def gib_text(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def share_text(share: float | None, seconds: float | None = None) -> str:
    if share is None:
        return "-" if seconds is None else seconds_text(seconds)
    text = f"{share * 100:.1f}%"
    return text if seconds is None else f"{text} ({seconds_text(seconds)})"


def render_health_markdown(health: dict[str, Any]) -> list[str]:
    """report.md's "Health" section."""
    out = ["## Health", ""]
    tp = health.get("throughput") or {}
    comm = health.get("comm") or {}
    if tp.get("images_per_s") is not None:
        line = (
            f"- throughput: **{tp['images_per_s']:.2f} images/s** (all ranks: {tp.get('samples')} samples "
            f"in {tp.get('steps')} steps over {seconds_text(tp.get('window_seconds'))})"
        )
        if tp.get("images_per_s_median") is not None:
            line += f"; median of the steps' own figure {tp['images_per_s_median']:.2f} images/s"
        out.append(line)
    elif tp.get("steps"):
        out.append(
            f"- throughput: {tp['steps']} steps (step times below); no images/s: the steps carry no sample count"
        )
    else:
        out.append("- throughput: no step events (the script did not report steps with `sdi.step`)")
    out.append(f"- backend: {comm.get('backend') or 'unknown'}")
    restarted = {r: h for r, h in (health.get("ranks") or {}).items() if (h.get("attempts") or 1) > 1}
    if restarted:
        earlier = ", ".join(f"rank {r}: {h.get('earlier_steps')}" for r, h in restarted.items())
        out.append(
            "- restarted by the launcher: the figures are of each rank's last attempt "
            f"(steps of the earlier attempts: {earlier})"
        )
    out += ["", _RANK_HEADER, "|---|---|---|---|---|---|---|---|---|"]
    for rank, r in (health.get("ranks") or {}).items():
        last = r.get("arrived_last")
        matched = r.get("matched_collectives")
        out.append(
            f"| {rank} | {r.get('host') or '-'} | {r.get('steps')} | {seconds_text(r.get('step_time_p50'))} "
            f"| {seconds_text(r.get('step_time_p95'))} "
            f"| {share_text(r.get('collective_share'), r.get('collective_seconds'))} "
            f"| {share_text(r.get('wait_share'), r.get('waited_seconds'))} "
            f"| {'-' if last is None else f'{last} of {matched}'} | {gib_text(r.get('mem_peak'))} |"
        )
    out += [
        "",
        '"in collectives": wall time inside traced collectives (a rank that waits for a slower one '
        'waits there); "waiting for others": the part of it between the rank\'s arrival and the last '
        'rank\'s arrival; "arrived last": how often the others waited for this rank.',
    ]
    out += _oom_markdown(health.get("oom") or {})
    out += _gpu_markdown(health.get("gpus") or {})
    out += _comm_markdown(comm)
    return out


_RANK_HEADER = (
    "| rank | host | steps | step p50 | step p95 | in collectives | waiting for others | arrived last "
    "| memory peak |"
)


def _oom_markdown(oom: dict[str, Any]) -> list[str]:
    fallbacks = oom.get("fallbacks") or []
    out = ["", "### Out of memory", ""]
    if not oom.get("events") and not fallbacks:
        return out + ["No OOM, no fallback."]
    out.append(
        f"{oom.get('events')} OOM event(s) on rank(s) {oom.get('ranks')}; {len(fallbacks)} fallback(s)."
    )
    if fallbacks:
        out += [
            "",
            "| step | micro-batch | grad accum | ranks out of memory | redone | reason |",
            "|---|---|---|---|---|---|",
        ]
        for f in fallbacks:
            out.append(
                f"| {f.get('step')} | {f.get('old_micro_batch')} -> {f.get('new_micro_batch')} "
                f"| {f.get('old_grad_accum')} -> {f.get('new_grad_accum')} | {f.get('failed_ranks')} "
                f"| {f.get('step_applied')} | {str(f.get('reason') or '').replace('|', '/')} |"
            )
    return out


def _gpu_markdown(gpus: dict[str, Any]) -> list[str]:
    if not gpus:
        return []
    out = [
        "",
        "### GPUs (sampled by sddoctor run)",
        "",
        "| GPU | name | utilisation mean / max | memory peak / total |",
    ]
    out.append("|---|---|---|---|")
    for key, g in gpus.items():
        util = "-" if g.get("util_mean") is None else f"{g['util_mean']:.0f}% / {g.get('util_max'):.0f}%"
        out.append(
            f"| {key} | {g.get('name')} | {util} | {gib_text(g.get('mem_peak'))} / {gib_text(g.get('mem_total'))} |"
        )
    return out


def _comm_markdown(comm: dict[str, Any]) -> list[str]:
    out = ["", "### Communication settings", ""]
    if not comm.get("recorded"):
        return out + ["Not recorded (the ranks started without sddoctor's instrumentation of this version)."]
    env = comm.get("env") or {}
    if env:
        out += [f"- `{name}={value}`" for name, value in env.items()]
    else:
        out.append(
            "No NCCL_*, TORCH_NCCL_*, GLOO_* or related variable was set: the defaults were in effect."
        )
    for name, per_rank in (comm.get("differ") or {}).items():
        values = ", ".join(f"rank {r}: {v if v is not None else '(unset)'}" for r, v in per_rank.items())
        out.append(f"- `{name}` differs between ranks: {values}")
    return out
