"""`sddoctor trace`: a run directory as a Chrome/Perfetto trace (JSON trace event format).

Open the file in ui.perfetto.dev (or chrome://tracing, or Perfetto's trace processor). Each rank
is a process ("rank 3 (host)") with these tracks:
- steps: one slice per step (loss, images/s, memory, micro-batch in its args);
- collectives: one slice per traced collective, from enqueue to completion, with a child slice
  "wait for rank N" from this rank's arrival to the last rank's arrival; a collective still in
  flight at the end runs to the rank's end and says so. Calls that overlap in time (async ops,
  NCCL calls whose completion is seen by polling) go to extra tracks "collectives 2", ..., since
  slices on one track must nest;
- events: OOMs, fallbacks, injected faults, exceptions, checkpoints, the exit, the hang (instants);
- counters: step time and loss per rank; GPU utilisation and memory (process "GPUs (host)") where
  `sddoctor run` sampled them.
The hang is also a global instant. Timestamps are microseconds since the first rank started;
`otherData.start_unix` gives that instant in unix seconds.

Format reference: the Trace Event Format document (ph X/i/C/M, ts and dur in microseconds).
`check_trace` verifies what Perfetto's JSON importer needs, and `write_trace` runs it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from sddoctor.supervise.rundata import RunData
from sddoctor.supervise.timeline import Call, Lane, Timeline

STEPS_TID, EVENTS_TID, CALLS_TID = 1, 2, 10  # collective tracks are 10, 11, ...
GPU_PID_BASE = 1_000_000
_PHASES = {"X", "i", "I", "C", "M"}
_META = {"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"}


def build_trace(data: RunData, last: float | None = None) -> dict[str, Any]:
    """The trace of the whole record, or of its `last` seconds (slices that reach into them)."""
    timeline = data.timeline
    origin = timeline.start if timeline.start is not None else 0.0
    events: list[dict[str, Any]] = []
    for lane in timeline.lanes.values():
        events += _lane_events(lane, origin)
    events += _hang_events(timeline, origin)
    events += _gpu_events(data.gpu_samples, origin)
    if last is not None and timeline.end is not None:
        cutoff = _us(timeline.end - last, origin)
        events = [e for e in events if e["ph"] == "M" or e["ts"] + e.get("dur", 0) >= cutoff]
    report = data.report
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "sddoctor trace",
            "run_dir": str(data.run_dir.path),
            "start_unix": origin,
            "outcome": report.get("outcome"),
            "verdicts": "; ".join(str(v.get("summary")) for v in report.get("verdicts") or []),
        },
    }


def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 3)


def _meta(pid: int, tid: int | None, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """A metadata event: process-wide ones (tid None) carry tid 0."""
    return {"ph": "M", "name": name, "pid": pid, "tid": 0 if tid is None else tid, "args": args}


def _lane_events(lane: Lane, origin: float) -> list[dict[str, Any]]:
    pid = lane.rank
    label = f"rank {lane.rank}" + (f" ({lane.host})" if lane.host else "")
    if lane.role:
        label += f" [{lane.role}]"
    out = [
        _meta(pid, None, "process_name", {"name": label}),
        _meta(pid, None, "process_sort_index", {"sort_index": lane.rank}),
        _meta(pid, STEPS_TID, "thread_name", {"name": "steps"}),
        _meta(pid, STEPS_TID, "thread_sort_index", {"sort_index": 0}),
        _meta(pid, EVENTS_TID, "thread_name", {"name": "events"}),
        _meta(pid, EVENTS_TID, "thread_sort_index", {"sort_index": 1}),
    ]
    for step in lane.steps:
        args = {k: v for k, v in step.fields.items() if isinstance(v, (int, float, str, bool)) and _finite(v)}
        out.append(_slice(pid, STEPS_TID, f"step {step.step}", "step", step.t0, step.t1, origin, args))
        out.append(_counter(pid, "step time (s)", step.t1, origin, {"seconds": step.t1 - step.t0}))
        loss = step.fields.get("loss")
        if isinstance(loss, (int, float)) and _finite(loss):
            out.append(_counter(pid, "loss", step.t1, origin, {"loss": loss}))
    end = lane.end if lane.end is not None else origin
    tracks: list[float] = []  # per collective track: when its last slice ends
    for call in lane.calls:
        call_end = max(call.end(end), call.t0)
        index = next((i for i, busy in enumerate(tracks) if busy <= call.t0), None)
        if index is None:
            index = len(tracks)
            tracks.append(0.0)
            name = "collectives" if index == 0 else f"collectives {index + 1}"
            out.append(_meta(pid, CALLS_TID + index, "thread_name", {"name": name}))
            out.append(_meta(pid, CALLS_TID + index, "thread_sort_index", {"sort_index": 2 + index}))
        tracks[index] = call_end
        out += _call_events(call, call_end, pid, CALLS_TID + index, origin)
    for mark in lane.marks:
        out.append(
            {
                "ph": "i",
                "s": "t",
                "name": mark.label,
                "cat": mark.kind,
                "pid": pid,
                "tid": EVENTS_TID,
                "ts": _us(mark.t, origin),
                "args": {"severity": mark.severity},
            }
        )
    return out


def _call_events(call: Call, call_end: float, pid: int, tid: int, origin: float) -> list[dict[str, Any]]:
    name = f"{call.op} #{call.seq}"
    args: dict[str, Any] = {
        "pg": call.pg,
        "seq": call.seq,
        "caller": call.caller,
        "polled_completion": call.polled,
    }
    if call.peer is not None:
        args["peer"] = call.peer
    if call.late_rank is not None:
        args["last_to_arrive"] = call.late_rank
    if call.wait is not None:
        args["wait_s"] = round(call.wait, 6)
    if call.t1 is None:
        name += " (still inside at the end)"
        args["in_flight"] = True
    out = [_slice(pid, tid, name, "collective", call.t0, call_end, origin, args)]
    if call.wait and call.wait > 0 and not call.last:
        who = f"rank {call.late_rank}" if call.late_rank is not None else "the other ranks"
        wait_end = min(call.t0 + call.wait, call_end)
        out.append(
            _slice(pid, tid, f"wait for {who}", "wait", call.t0, wait_end, origin, {"seconds": call.wait})
        )
    return out


def _slice(
    pid: int, tid: int, name: str, cat: str, t0: float, t1: float, origin: float, args: dict[str, Any]
) -> dict[str, Any]:
    ts = _us(t0, origin)
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": max(0.0, round(_us(t1, origin) - ts, 3)),
        "args": args,
    }


def _counter(pid: int, name: str, t: float, origin: float, values: dict[str, float]) -> dict[str, Any]:
    return {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": _us(t, origin), "args": values}


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _hang_events(timeline: Timeline, origin: float) -> list[dict[str, Any]]:
    out = []
    for lane in timeline.lanes.values():
        for mark in lane.marks:
            if mark.kind == "hang" and mark.label.startswith("hang declared"):
                out.append(
                    {
                        "ph": "i",
                        "s": "g",
                        "name": mark.label,
                        "cat": "hang",
                        "pid": 0,
                        "tid": 0,
                        "ts": _us(mark.t, origin),
                    }
                )
                return out
    return out


def _gpu_events(samples: list[dict[str, Any]], origin: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    hosts: dict[str, int] = {}
    for line in samples:
        host = str(line.get("host"))
        if host not in hosts:
            pid = hosts[host] = GPU_PID_BASE + len(hosts)
            out.append(_meta(pid, None, "process_name", {"name": f"GPUs ({host})"}))
            out.append(_meta(pid, None, "process_sort_index", {"sort_index": GPU_PID_BASE + len(hosts)}))
        pid = hosts[host]
        for g in line.get("gpus") or []:
            if isinstance(g.get("util"), (int, float)):
                out.append(
                    _counter(
                        pid, f"GPU {g.get('index')} utilisation (%)", line["t"], origin, {"util": g["util"]}
                    )
                )
            if isinstance(g.get("mem_used"), (int, float)):
                out.append(
                    _counter(
                        pid,
                        f"GPU {g.get('index')} memory (GiB)",
                        line["t"],
                        origin,
                        {"GiB": g["mem_used"] / 2**30},
                    )
                )
    return out


def check_trace(trace: dict[str, Any]) -> list[str]:
    """Problems that would make Perfetto's JSON importer drop or misplace events ([] when none).

    Every event has a known `ph`, integer pid/tid, a finite `ts` (and `dur` >= 0 for slices);
    metadata events name a process or thread; counter values are finite numbers; instants have
    a valid scope; and the slices of each (pid, tid) nest (none overlaps another's end).
    """
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, e in enumerate(events):
        found = _check_event(e)
        problems += [f"event {i}: {p}" for p in found]
        if not found and e.get("ph") == "X":
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for (pid, tid), spans in slices.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            # ts and dur are rounded to the nanosecond each: their sum may miss the next start by
            # a float's last bit, as the overlap test below allows
            while stack and stack[-1][1] <= start + 1e-3:
                stack.pop()
            if stack and end > stack[-1][1] + 1e-3:
                problems.append(f"pid {pid} tid {tid}: {name!r} overlaps the end of {stack[-1][2]!r}")
            stack.append((start, end, name))
    return problems


def _check_event(e: Any) -> list[str]:
    if not isinstance(e, dict):
        return ["not an object"]
    ph = e.get("ph")
    if ph not in _PHASES:
        return [f"unknown ph {ph!r}"]
    out = []
    if not isinstance(e.get("name"), str) or not e["name"]:
        out.append("no name")
    for key in ("pid", "tid"):
        if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
            out.append(f"{key} is not an integer")
    if ph == "M":
        if e.get("name") not in _META or not isinstance(e.get("args"), dict):
            out.append(f"bad metadata {e.get('name')!r}")
        return out
    ts = e.get("ts")
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        out.append("ts is not a finite number")
    if ph == "X" and (not isinstance(e.get("dur"), (int, float)) or not e["dur"] >= 0):
        out.append("dur is not a number >= 0")
    if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
        out.append(f"bad instant scope {e.get('s')!r}")
    if ph == "C":
        args = e.get("args")
        if not isinstance(args, dict) or not args:
            out.append("counter without values")
        elif not all(isinstance(v, (int, float)) and math.isfinite(v) for v in args.values()):
            out.append("counter value is not a finite number")
    return out


def write_trace(data: RunData, path: str, last: float | None = None) -> dict[str, Any]:
    """Build, check and write the trace (atomically). Raises ValueError if the check fails."""
    from pathlib import Path

    from sddoctor.telemetry.layout import atomic_write_text

    trace = build_trace(data, last)
    problems = check_trace(trace)
    if problems:
        raise ValueError("; ".join(problems[:5]))
    atomic_write_text(Path(path), json.dumps(trace, allow_nan=False, separators=(",", ":")))
    return trace
