"""/metrics of `sddoctor run`: the run as Prometheus series (docs/run.md#prometheus-metrics).

`RunMetrics.update(state, verdicts, hang_handled)` is called by the supervisor once a tick with
the watcher's `RunState`; it also tails each rank's event log for step events (every step's time
goes into a histogram, not only the one a snapshot happens to show). `render(accept)` is called
from the HTTP thread and exposes what the last update saw through prometheus_client's own
exposition (text format 0.0.4, or OpenMetrics when the scraper asks for it), with GPU gauges
sampled at scrape time when NVML is there.

Labels are stable: `rank` and `node` (the rank's host) on every per-rank series, `pg` on the
per-process-group ones; a series, once there, keeps its label set (the last collective seq is
kept per process group instead of following whichever group finished last). Ranks watched by a
peer's supervisor (--peers) are left to that node's /metrics.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.telemetry import EventTail, RunDir
from sddoctor.telemetry.snapshot import StepRecord

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def buckets(self) -> list[tuple[str, float]]:
        counts = self.counts or [0] * len(self.bounds)
        return [(_le(b), float(c)) for b, c in zip(self.bounds, counts, strict=True)] + [
            ("+Inf", float(self.n))
        ]


def _le(bound: float) -> str:
    return repr(float(bound))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class _RankSeries:
    """What /metrics keeps of one rank between updates."""

    labels: tuple[str, str]  # rank, node
    steps: int = 0
    samples: float = 0.0
    last_step_t: float | None = None
    step_seconds: _Histogram = field(default_factory=lambda: _Histogram(STEP_BUCKETS))
    wait_seconds: dict[str, _Histogram] = field(default_factory=dict)
    last_observed_seq: dict[str, int] = field(default_factory=dict)
    last_done_seq: dict[str, float] = field(default_factory=dict)
    issued: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    mem: dict[str, float] = field(default_factory=dict)
    totals: tuple[float, float] = (0.0, 0.0)  # collectives completed, seconds inside them
    ooms: int = 0
    fallbacks: int = 0


class RunMetrics:
    """Prometheus series of one run on this node."""

    def __init__(self, run_dir: RunDir, gpu_source: Any = None, node: str | None = None) -> None:
        self.run_dir = run_dir
        self.node = node or socket.gethostname()
        self.gpu_source = gpu_source
        self.started = time.time()
        self._lock = threading.Lock()
        self._tails: dict[int, EventTail] = {}
        self._ranks: dict[int, _RankSeries] = {}
        self._verdicts: list[dict[str, Any]] = []
        self._hang = False
        self._hangs = 0
        self._crashes: set[tuple[Any, ...]] = set()

    # -- fed by the supervisor loop ---------------------------------------------------------------

    def update(self, state: RunState, verdicts: list[Verdict], hang_handled: bool = False) -> None:
        """Take in the watcher's view (and the new step events) after a tick."""
        with self._lock:
            for rank in state.ranks.values():
                if rank.remote:
                    continue
                series = self._series(rank)
                self._read_steps(rank.rank, series)
                self._read_state(rank, series, state.now)
            self._verdicts = [v.to_dict() if isinstance(v, Verdict) else dict(v) for v in verdicts]
            for v in self._verdicts:
                if v.get("kind") in ("crash", "exited_early"):
                    self._crashes.add((v.get("kind"), v.get("culprit_rank")))
            hang_now = bool(hang_handled) or any(
                str(v.get("kind", "")).startswith("hang.") and not (v.get("details") or {}).get("resolved")
                for v in self._verdicts
            )
            if hang_now and not self._hang:
                self._hangs += 1  # one more hang episode diagnosed
            self._hang = hang_now

    def _series(self, rank: RankState) -> _RankSeries:
        series = self._ranks.get(rank.rank)
        if series is None:
            series = self._ranks[rank.rank] = _RankSeries((str(rank.rank), str(rank.host or self.node)))
        return series

    def _read_steps(self, rank_id: int, series: _RankSeries) -> None:
        tail = self._tails.setdefault(rank_id, EventTail(self.run_dir.events_file(rank_id)))
        for event in tail.poll():
            if event.get("kind") != "step":
                continue
            step = StepRecord.of(event)
            series.steps += 1
            samples = step.samples
            if samples is not None and samples >= 0:
                series.samples += samples
            t = step.t
            seconds = step.step_time
            if seconds is None and t is not None and series.last_step_t is not None:
                seconds = t - series.last_step_t  # a script reporting steps without their time
            if seconds is not None and seconds >= 0:
                series.step_seconds.observe(seconds)
            series.last_step_t = t if t is not None else series.last_step_t

    def _read_state(self, rank: RankState, series: _RankSeries, now: float) -> None:
        snap = rank.snapshot
        last = snap.last_step
        g: dict[str, float] = {}
        if snap.step is not None:
            g["step"] = float(snap.step)
        if last.loss is not None:
            g["loss"] = last.loss
        if last.samples is not None and last.step_time:
            g["images_per_second"] = last.samples / last.step_time
        for kind, value in (
            ("allocated", last.mem_alloc),
            ("peak", last.mem_peak),
            ("reserved", last.mem_reserved),
        ):
            if value is not None:
                series.mem[kind] = value
        if rank.alive is not None or rank.exited:
            g["alive"] = 0.0 if rank.exited else 1.0
        if snap.heartbeat is not None:
            g["heartbeat_age"] = max(0.0, now - snap.heartbeat)
        since = min((c.since or now for c in snap.inflight), default=None)
        g["inflight"] = max(0.0, now - since) if since is not None else 0.0
        series.gauges = g
        for pg, seq in snap.issued.items():
            series.issued[pg] = max(series.issued.get(pg, 0.0), float(seq))
        done = snap.last_done
        if done is not None and done.seq is not None:
            series.last_done_seq[done.pg] = max(series.last_done_seq.get(done.pg, 0.0), float(done.seq))
        if snap.total_count is not None and snap.total_seconds is not None:
            series.totals = (
                max(series.totals[0], snap.total_count),
                max(series.totals[1], snap.total_seconds),
            )
        for pg, arrivals in rank.arrivals.items():
            newest = series.last_observed_seq.get(pg, 0)
            for seq in sorted(s for s in arrivals if s > newest):
                duration = arrivals[seq].duration
                if duration is None:
                    break  # still in flight: later sightings fill it in
                series.wait_seconds.setdefault(pg, _Histogram(WAIT_BUCKETS)).observe(max(0.0, duration))
                series.last_observed_seq[pg] = seq
        series.ooms = max(series.ooms, len(rank.ooms))
        series.fallbacks = max(series.fallbacks, len(rank.fallbacks))

    # -- read by the HTTP thread ------------------------------------------------------------------

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition for a scrape: (body, content type), in the format `accept` asks for."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type

    # Over 80 lines: a table of the per-rank metric families, filled in one pass under the lock.
    def families(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        rl = ["rank", "node"]
        with self._lock:
            ranks = sorted(self._ranks.items())
            verdicts = list(self._verdicts)
            hang, hangs, crashes = self._hang, self._hangs, len(self._crashes)

            steps = CounterMetricFamily("sddoctor_steps", "Training steps the rank reported.", labels=rl)
            samples = CounterMetricFamily("sddoctor_samples", "Samples (images) of those steps.", labels=rl)
            colls = CounterMetricFamily(
                "sddoctor_collectives", "Collectives the rank issued, per process group.", labels=[*rl, "pg"]
            )
            done = CounterMetricFamily(
                "sddoctor_collectives_completed", "Traced collectives completed (all groups).", labels=rl
            )
            inside = CounterMetricFamily(
                "sddoctor_collective_seconds",
                "Seconds spent inside completed traced collectives (all groups).",
                labels=rl,
            )
            ooms = CounterMetricFamily("sddoctor_ooms", "Out-of-memory errors the rank reported.", labels=rl)
            fallbacks = CounterMetricFamily(
                "sddoctor_oom_fallbacks", "Micro-batch fallbacks after an out-of-memory error.", labels=rl
            )
            step_h = HistogramMetricFamily("sddoctor_step_seconds", "Time of each training step.", labels=rl)
            wait_h = HistogramMetricFamily(
                "sddoctor_collective_wait_seconds",
                "Time inside a collective, from the collectives the about 1 Hz rank snapshot shows "
                "(a sample, not every call; exact totals: sddoctor_collective_seconds_total).",
                labels=[*rl, "pg"],
            )
            g = {
                "step": GaugeMetricFamily("sddoctor_rank_step", "Last finished step of the rank.", labels=rl),
                "loss": GaugeMetricFamily("sddoctor_rank_loss", "Loss of the rank's last step.", labels=rl),
                "images_per_second": GaugeMetricFamily(
                    "sddoctor_rank_images_per_second",
                    "This rank's images per second in its last step (sum over ranks: the job's).",
                    labels=rl,
                ),
                "alive": GaugeMetricFamily(
                    "sddoctor_rank_alive", "1 while the rank process runs.", labels=rl
                ),
                "heartbeat_age": GaugeMetricFamily(
                    "sddoctor_rank_heartbeat_age_seconds",
                    "Seconds since the rank's heartbeat ticked.",
                    labels=rl,
                ),
                "inflight": GaugeMetricFamily(
                    "sddoctor_rank_collective_inflight_seconds",
                    "Seconds the rank has been inside its current collective (0: none).",
                    labels=rl,
                ),
            }
            mem = GaugeMetricFamily(
                "sddoctor_rank_memory_bytes",
                "Device memory of the rank's last step (allocated, peak, reserved).",
                labels=[*rl, "kind"],
            )
            last_seq = GaugeMetricFamily(
                "sddoctor_rank_last_collective_seq",
                "Seq of the last completed collective, per process group.",
                labels=[*rl, "pg"],
            )
            for _, s in ranks:
                steps.add_metric(s.labels, s.steps)
                samples.add_metric(s.labels, s.samples)
                for pg, seq in sorted(s.issued.items()):
                    colls.add_metric([*s.labels, pg], seq)
                done.add_metric(s.labels, s.totals[0])
                inside.add_metric(s.labels, s.totals[1])
                ooms.add_metric(s.labels, s.ooms)
                fallbacks.add_metric(s.labels, s.fallbacks)
                step_h.add_metric(s.labels, s.step_seconds.buckets(), s.step_seconds.total)
                for pg, hist in sorted(s.wait_seconds.items()):
                    wait_h.add_metric([*s.labels, pg], hist.buckets(), hist.total)
                for key, family in g.items():
                    if key in s.gauges:
                        family.add_metric(s.labels, s.gauges[key])
                for kind, value in sorted(s.mem.items()):
                    mem.add_metric([*s.labels, kind], value)
                for pg, seq in sorted(s.last_done_seq.items()):
                    last_seq.add_metric([*s.labels, pg], seq)
        yield from (
            steps,
            samples,
            colls,
            done,
            inside,
            ooms,
            fallbacks,
            step_h,
            wait_h,
            *g.values(),
            mem,
            last_seq,
        )
        yield from self._job_families(verdicts, hang, hangs, crashes)
        yield from self._gpu_families()

    def _job_families(
        self, verdicts: list[dict[str, Any]], hang: bool, hangs: int, crashes: int
    ) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        node = [self.node]
        fam: CounterMetricFamily | GaugeMetricFamily
        fam = CounterMetricFamily("sddoctor_hangs", "Hangs diagnosed on this node.", labels=["node"])
        fam.add_metric(node, hangs)
        yield fam
        fam = CounterMetricFamily(
            "sddoctor_crashes", "Crashes diagnosed (one per rank that died first).", labels=["node"]
        )
        fam.add_metric(node, crashes)
        yield fam
        fam = GaugeMetricFamily(
            "sddoctor_hang", "1 while a hang is diagnosed and not resolved.", labels=["node"]
        )
        fam.add_metric(node, 1 if hang else 0)
        yield fam
        fam = GaugeMetricFamily(
            "sddoctor_verdict",
            "1 for each current verdict of the diagnosis (rank: the culprit, '' when none).",
            labels=["node", "kind", "severity", "rank"],
        )
        for v in verdicts:
            culprit = v.get("culprit_rank")
            fam.add_metric(
                [
                    self.node,
                    str(v.get("kind")),
                    str(v.get("severity")),
                    "" if culprit is None else str(culprit),
                ],
                1,
            )
        yield fam
        fam = GaugeMetricFamily("sddoctor_verdicts", "Number of current verdicts.", labels=["node"])
        fam.add_metric(node, len(verdicts))
        yield fam
        fam = GaugeMetricFamily(
            "sddoctor_start_time_seconds", "When this supervisor started (unix time).", labels=["node"]
        )
        fam.add_metric(node, self.started)
        yield fam

    def _gpu_families(self) -> Iterator[Any]:
        if self.gpu_source is None:
            return
        from prometheus_client.core import GaugeMetricFamily

        try:
            if not self.gpu_source.available:
                return
            samples = self.gpu_source.sample()
        except Exception:  # noqa: BLE001 - a driver problem costs the GPU series, not the scrape
            return
        labels = ["node", "gpu", "uuid"]
        util = GaugeMetricFamily("sddoctor_gpu_utilization_ratio", "GPU busy share (0-1).", labels=labels)
        used = GaugeMetricFamily("sddoctor_gpu_memory_used_bytes", "GPU memory in use.", labels=labels)
        total = GaugeMetricFamily("sddoctor_gpu_memory_total_bytes", "GPU memory size.", labels=labels)
        temp = GaugeMetricFamily("sddoctor_gpu_temperature_celsius", "GPU temperature.", labels=labels)
        power = GaugeMetricFamily("sddoctor_gpu_power_watts", "GPU power draw.", labels=labels)
        for s in samples:
            key = [self.node, str(s.index), str(s.uuid)]
            for family, value in (
                (util, None if s.utilization_gpu is None else s.utilization_gpu / 100.0),
                (used, s.memory_used),
                (total, s.memory_total),
                (temp, s.temperature),
                (power, s.power_draw),
            ):
                if _number(value) is not None:
                    family.add_metric(key, float(value))  # type: ignore[arg-type]
        yield from (util, used, total, temp, power)


class _Collector:
    def __init__(self, metrics: RunMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self.metrics.families()
