"""What each DDP rank is doing, derived from its telemetry (pure functions, no I/O).

Input is what a rank writes (its state snapshot, see the state contract in
docs/telemetry.md, and a few of its events) and the verdicts of `sddoctor run`; output is a
`RankStatus` with a one-word `state` and a sentence saying it:

  training      steps are advancing
  collective    inside collective #k for at least `COLLECTIVE_SHOWN_AFTER` seconds
  hung          a hang verdict names this rank, or it sat in one collective for `HUNG_AFTER` s
  silent        the rank stopped writing its snapshot/heartbeat (`SILENT_AFTER` s)
  oom-fallback  recovered from an OOM by a smaller micro-batch in the last `FALLBACK_SHOWN_FOR` s
  crashed       exited with an error or a signal, or its process is gone without an exit record
  exited        exited normally
  running       no step reported, but collectives are issued (an unchanged program without DDP):
                its last collective and how many it issues a second
  stuck         no step and no collective the start-up allowance after the rank started (run.json's
                `sddoctor run --startup-timeout`, else its default); its stack once sddoctor took it
  starting      no step finished and no collective issued yet, within the allowance
"""

from __future__ import annotations

import collections
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from sddoctor.telemetry.runinfo import STARTUP_TIMEOUT
from sddoctor.telemetry.snapshot import Collective, RankSnapshot

COLLECTIVE_SHOWN_AFTER = 1.0
HUNG_AFTER = 120.0
SILENT_AFTER = 30.0
FALLBACK_SHOWN_FOR = 60.0
RATE_WINDOW = 30.0


@dataclass
class RankStatus:
    rank: int
    node: str  # where it was read from: the run dir name or HOST:PORT
    host: str | None = None
    pid: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    device: int | None = (
        None  # physical GPU index: the rank's CUDA index through CUDA_VISIBLE_DEVICES, else local_rank
    )
    device_uuid: str | None = None
    step: int | None = None
    loss: float | None = None
    it_s: float | None = None
    images_s: float | None = None  # this rank's own images (its reported samples) per second
    micro_batch: int | None = None
    grad_accum: int | None = None
    mem_peak: int | None = None
    phase: str | None = None
    state: str = "starting"
    state_text: str = "no step finished yet"
    last_collective: str | None = None
    inflight: str | None = None  # "all_reduce #812": in flight for COLLECTIVE_SHOWN_AFTER s or more
    inflight_for: float | None = None  # seconds it has been in flight
    call_site: str | None = None
    heartbeat_age: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RankInputs:
    """Everything known about one rank at one moment; feeds fill it, `derive` reads it."""

    rank: int
    node: str
    state: dict[str, Any] | None = None
    start: dict[str, Any] | None = None
    exit: dict[str, Any] | None = None
    exception: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None
    oom: dict[str, Any] | None = None
    pid_alive: bool | None = None  # None: cannot tell (another host)


class RateTracker:
    """it/s and images/s of one rank from the steps it reported, over the last RATE_WINDOW s."""

    def __init__(self) -> None:
        self._points: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=512)
        self._collectives: collections.deque[tuple[float, float]] = collections.deque(maxlen=512)

    def add_collectives(self, t: float | None, count: float | None) -> None:
        """The rank's cumulative count of completed collectives at snapshot time `t`."""
        if t is None or count is None or (self._collectives and t <= self._collectives[-1][0]):
            return
        self._collectives.append((float(t), float(count)))

    def collectives_per_s(self) -> float | None:
        pts = [p for p in self._collectives if p[0] >= self._collectives[-1][0] - RATE_WINDOW]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def add(self, t: float | None, step: int | None, samples: float | None) -> None:
        if t is None or step is None:
            return
        if self._points and step <= self._points[-1][1]:
            return  # the same step seen again (state polled twice) or a restart
        self._points.append((float(t), int(step), float(samples or 0)))

    def rates(
        self, step_time: float | None = None, samples: float | None = None
    ) -> tuple[float | None, float | None]:
        pts = [p for p in self._points if p[0] >= self._points[-1][0] - RATE_WINDOW] if self._points else []
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            dt = pts[-1][0] - pts[0][0]
            steps = pts[-1][1] - pts[0][1]
            imgs = sum(p[2] for p in pts[1:])
            return steps / dt, (imgs / dt if imgs else None)
        if step_time:
            return 1.0 / step_time, (samples / step_time if samples else None)
        return None, None


#: States of a rank that makes no progress: its last rate is history, not part of the job's rate.
STOPPED = ("exited", "crashed", "hung", "silent")


def images_total(ranks: list[RankStatus]) -> float | None:
    """Images per second of the whole job: the sum of the own images/s of each rank that is not
    stopped (`RankStatus.images_s` is per rank: the samples that rank reported, over time)."""
    rates = [r.images_s for r in ranks if r.images_s is not None and r.state not in STOPPED]
    return sum(rates) if rates else None


def parse_device(value: Any) -> int | None:
    """3, "3", "cuda:3" -> 3; "cpu", None -> None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"(?:cuda:)?(\d+)", value.strip())
        if m:
            return int(m.group(1))
    return None


def derive(
    inputs: RankInputs,
    rates: RateTracker,
    verdicts: list[dict[str, Any]],
    now: float,
    startup_allowance: float = STARTUP_TIMEOUT,
    run_started: float | None = None,
) -> RankStatus:
    """The rank's status at `now`. `startup_allowance` and `run_started` (the run's start, used when
    the rank's own `start` event is not known) come from run.json when there is one."""
    snap = RankSnapshot.of(inputs.state)
    start = inputs.start or {}
    status = RankStatus(rank=inputs.rank, node=inputs.node)
    _fill_identity(status, snap, start)
    _fill_progress(status, snap, rates, now)
    oldest = _fill_collectives(status, snap, rates, now)

    mine = [v for v in verdicts if isinstance(v, dict) and v.get("culprit_rank") == inputs.rank]
    started = _first(_float(start.get("t")), run_started)
    state = _stopped_state(status, inputs, snap, mine) or _live_state(
        status, inputs, snap, rates, oldest, now, started, startup_allowance
    )
    if state is not None:
        status.state, status.state_text = state
    if inputs.fallback is not None:
        status.notes.append(_fallback_text(inputs.fallback))
    if inputs.oom is not None:
        oom = inputs.oom
        status.notes.append(f"OOM at step {oom.get('step', '?')} in {oom.get('phase', '?')}")
    for v in mine:
        status.notes.append(f"{v.get('severity', 'info')}: {v.get('summary', v.get('kind'))}")
    return status


def _fill_identity(status: RankStatus, snap: RankSnapshot, start: dict[str, Any]) -> None:
    """Host, pid, ranks and the physical GPU: from the snapshot, else from the `start` event."""
    status.host = snap.host or start.get("host")
    status.pid = _first(snap.pid, _int(start.get("pid")))
    status.local_rank = _first(snap.local_rank, _int(start.get("local_rank")))
    status.world_size = _first(snap.world_size, _int(start.get("world_size")))
    device = parse_device(_first(snap.device, start.get("device")))
    status.device = device if device is not None else status.local_rank
    status.device_uuid = _first(snap.device_uuid, start.get("device_uuid"))
    visible = _first(snap.cuda_visible_devices, start.get("cuda_visible_devices"))
    if status.device is not None and isinstance(visible, str) and visible.strip():
        # CUDA index -> physical GPU: the rank's index counts within CUDA_VISIBLE_DEVICES
        entries = [e.strip() for e in visible.split(",")]
        if status.device < len(entries):
            entry = entries[status.device]
            if entry.isdigit():
                status.device = int(entry)
            elif entry.startswith("GPU-") and not status.device_uuid:
                status.device_uuid = entry


def _fill_progress(status: RankStatus, snap: RankSnapshot, rates: RateTracker, now: float) -> None:
    """The step, its loss and batch, the rates (fed with this snapshot's step) and the heartbeat."""
    status.phase = snap.phase
    last = snap.last_step
    status.step = _first(snap.step, last.step)
    status.loss = last.loss
    status.micro_batch = last.micro_batch
    status.grad_accum = last.grad_accum
    status.mem_peak = None if last.mem_peak is None else int(last.mem_peak)
    rates.add(last.t, status.step, last.samples)
    status.it_s, status.images_s = rates.rates(last.step_time, last.samples)
    hb = snap.alive_at
    status.heartbeat_age = None if hb is None else max(0.0, now - hb)


def _fill_collectives(
    status: RankStatus, snap: RankSnapshot, rates: RateTracker, now: float
) -> Collective | None:
    """The last collective done, the one in flight, and the call site: where the rank is; returns
    the oldest collective in flight (None when there is none)."""
    rates.add_collectives(snap.t, snap.total_count)
    oldest = min(snap.inflight, key=lambda c: _since(c, now)) if snap.inflight else None
    done = snap.last_done
    if done is not None:
        dur = done.duration
        status.last_collective = f"{done.op or '?'} #{_seq(done)}" + (
            f" {_fmt_seconds(dur)}" if dur is not None else ""
        )
    # the call it waits in; else where its main thread is in the user's code (a rank stuck reading
    # data is there, not at its last collective); else its last collective
    status.call_site = (
        oldest.caller if oldest is not None else snap.main_at or (done.caller if done else None)
    )
    if oldest is not None and now - _since(oldest, now) >= COLLECTIVE_SHOWN_AFTER:
        status.inflight = f"{oldest.op or 'collective'} #{_seq(oldest)}"
        status.inflight_for = now - _since(oldest, now)
    return oldest


def _stopped_state(
    status: RankStatus, inputs: RankInputs, snap: RankSnapshot, mine: list[dict[str, Any]]
) -> tuple[str, str] | None:
    """Exited, crashed or hung by its exit record, the process table or a verdict naming it."""
    exit_ev = inputs.exit
    if exit_ev is None and snap.exited:
        exit_ev = {"status": "ok"}
    if exit_ev is not None:
        if exit_ev.get("status") in (None, "ok") and _int(exit_ev.get("code")) in (None, 0):
            return "exited", "exited normally"
        return "crashed", _crash_text(exit_ev, inputs.exception)
    if any(str(v.get("kind", "")).startswith("crash") for v in mine):
        v = next(v for v in mine if str(v.get("kind", "")).startswith("crash"))
        return "crashed", str(v.get("summary") or "crashed")
    if inputs.pid_alive is False:
        return "crashed", f"process {status.pid} is gone without an exit record"
    if any(str(v.get("kind", "")).startswith("hang") for v in mine):
        v = next(v for v in mine if str(v.get("kind", "")).startswith("hang"))
        return "hung", str(v.get("summary") or "hung")
    return None


def _live_state(
    status: RankStatus,
    inputs: RankInputs,
    snap: RankSnapshot,
    rates: RateTracker,
    oldest: Collective | None,
    now: float,
    started: float | None,
    startup_allowance: float,
) -> tuple[str, str] | None:
    """What a rank that has not stopped does: in a collective, silent, recovering from an OOM,
    training, running without steps, or stuck at start; None while it is still starting."""
    if oldest is not None and now - _since(oldest, now) >= COLLECTIVE_SHOWN_AFTER:
        age = now - _since(oldest, now)
        state = "hung" if age >= HUNG_AFTER else "collective"
        return state, f"in {oldest.op or 'collective'} #{_seq(oldest)} for {age:.0f} s"
    if status.heartbeat_age is not None and status.heartbeat_age >= SILENT_AFTER:
        return "silent", f"no heartbeat for {status.heartbeat_age:.0f} s"
    if inputs.fallback is not None and now - (_float(inputs.fallback.get("t")) or 0) < FALLBACK_SHOWN_FOR:
        return "oom-fallback", _fallback_text(inputs.fallback)
    if status.step is not None:
        text = f"step {status.step}"
        if status.phase:
            text += f", {status.phase}"
        return "training", text
    if snap.issued or snap.last_done is not None or oldest is not None:
        per_s = rates.collectives_per_s()
        text = "no step reported; " + (
            f"last collective {status.last_collective}"
            if status.last_collective
            else "in its first collective"
        )
        if per_s is not None:
            text += f", {per_s:.1f} collectives/s"
        return "running", text
    if started is not None and now - started >= startup_allowance:
        text = f"stuck at start: no step or collective {now - started:.0f} s after it started"
        if snap.waiting is not None:
            text += f", waiting in {snap.waiting['what']}"
        return "stuck", text
    return None


def _since(collective: Collective, now: float) -> float:
    return now if collective.since is None else collective.since


def _seq(collective: Collective) -> str:
    return "?" if collective.seq is None else str(collective.seq)


def _crash_text(exit_ev: dict[str, Any], exc: dict[str, Any] | None) -> str:
    if exc is not None:
        return f"crashed: {exc.get('type', 'exception')}: {str(exc.get('message', ''))[:80]}".rstrip(": ")
    if exit_ev.get("status") == "signal":
        return f"killed by signal {exit_ev.get('code', '?')}"
    return f"exited with code {exit_ev.get('code', '?')}"


def _fallback_text(ev: dict[str, Any]) -> str:
    return (
        f"OOM fallback at step {ev.get('step', '?')}: micro-batch "
        f"{ev.get('old_micro_batch', '?')}->{ev.get('new_micro_batch', '?')}, "
        f"accumulation {ev.get('old_grad_accum', '?')}->{ev.get('new_grad_accum', '?')}"
    )


def _fmt_seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.1f} s"


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _int(v: Any) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    try:
        return None if v is None or isinstance(v, bool) else float(v)
    except (TypeError, ValueError):
        return None
