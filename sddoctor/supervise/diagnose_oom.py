"""Out-of-memory verdicts: OOM events, and whether the trainer's fallback absorbed them."""

from __future__ import annotations

import re
from typing import Any

from sddoctor.supervise.diagnose_base import exception_location
from sddoctor.supervise.state import RunState, Verdict

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.IGNORECASE)


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, (int, float)) else "?"


def diagnose_oom(state: RunState) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        for oom in rank.ooms:
            t = oom.get("t", 0.0)
            fallback = next(
                (
                    f
                    for r in state.ranks.values()
                    for f in r.fallbacks
                    if f.get("t", 0.0) >= t - 1.0
                    and (f.get("step") in (None, oom.get("step")) or r.rank == rank.rank)
                ),
                None,
            )
            if fallback is None and not rank.exited and state.job_exit is None and state.now - t < 10.0:
                continue  # the fallback may still be on its way: decide once it came or the rank died
            phase = oom.get("phase", "?")
            if oom.get("mem_alloc") is None and oom.get("mem_total") is None:
                mem = "no device memory figures: not on a CUDA device"
            else:
                mem = (
                    f"allocated {_gib(oom.get('mem_alloc'))}, reserved {_gib(oom.get('mem_reserved'))}"
                    f" of {_gib(oom.get('mem_total'))}"
                )
            details: dict[str, Any] = {
                k: oom.get(k) for k in ("step", "phase", "micro_batch", "grad_accum") if k in oom
            }
            details.update(
                mem_alloc=oom.get("mem_alloc"),
                mem_reserved=oom.get("mem_reserved"),
                mem_total=oom.get("mem_total"),
            )
            evidence = [f"oom event of rank {rank.rank}: {str(oom.get('message', ''))[:200]}"]
            if fallback is not None:
                details["fallback"] = {k: v for k, v in fallback.items() if k not in ("v", "kind")}
                summary = (
                    f"rank {rank.rank} ran out of memory in {phase} at step {oom.get('step')} ({mem}); "
                    f"the trainer's fallback recovered: micro-batch {fallback.get('old_micro_batch')}"
                    f" -> {fallback.get('new_micro_batch')}, grad_accum {fallback.get('old_grad_accum')}"
                    f" -> {fallback.get('new_grad_accum')}"
                )
                verdicts.append(
                    Verdict("oom.recovered", "info", summary, rank.rank, oom.get("caller"), details, evidence)
                )
            else:
                summary = f"rank {rank.rank} ran out of memory in {phase} at step {oom.get('step')} ({mem})"
                if rank.exception:
                    details["exception"] = {k: rank.exception.get(k) for k in ("type", "message")}
                    details["traceback"] = rank.exception.get("traceback")
                    summary += f"; it stopped with {rank.exception.get('type')}"
                location = oom.get("caller") or exception_location(rank.exception, rank)
                verdicts.append(Verdict("oom", "error", summary, rank.rank, location, details, evidence))
        exc = rank.exception
        any_oom_event = any(r.ooms for r in state.ranks.values())
        if not any_oom_event and exc and OOM_TEXT.search(f"{exc.get('type')} {exc.get('message')}"):
            verdicts.append(
                Verdict(
                    "oom",
                    "error",
                    f"rank {rank.rank} died of out-of-memory: {str(exc.get('message'))[:160]}",
                    rank.rank,
                    exception_location(exc, rank),
                    {
                        "step": rank.snapshot.step,
                        "phase": rank.snapshot.phase,
                        "traceback": exc.get("traceback"),
                    },
                    [f"exception event of rank {rank.rank}: {exc.get('type')}"],
                )
            )
    return verdicts


#: torch's words for a DataLoader worker that died of a signal ("...(pid 1234) is killed by signal:
#: Killed.") or vanished ("...(pid(s) 1234, 1235) exited unexpectedly")
_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal|exited unexpectedly)"
)

HOST_OOM_ADVICE = (
    "the kernel's OOM killer ends a process when the host runs out of memory (RAM, not the GPU's): "
    "every rank and each of its DataLoader workers holds its own copies (the dataset, models kept on "
    "the CPU); fewer workers per rank (num_workers), a smaller prefetch_factor, datasets that read "
    "from disk instead of holding their data, or more host memory; `dmesg` lists each kill"
)


def host_oom_finding(
    state: RunState, pid: int | None, killed_hard: bool, exception_message: str | None
) -> tuple[str, dict[str, Any]] | None:
    """What the kernel's OOM killer had to do with a rank's death: (a clause for the verdict's
    summary, the `host_oom` details), or None when nothing says it did. `killed_hard`: the rank
    died of SIGKILL (not an injected one) or vanished without an exit record."""
    record = state.host_oom or {}
    kills = record.get("kills")
    if not isinstance(kills, int) or kills <= 0:
        return None
    killed = {str(p): str(c) for p, c in (record.get("killed") or {}).items()}
    match = _WORKER_DIED.search(exception_message or "")
    workers = [w.strip() for w in match.group(1).split(",") if w.strip()] if match else []
    details: dict[str, Any] = {"kills": kills, "source": record.get("source"), "killed": killed or None}
    if pid is not None and str(pid) in killed:
        details["pid"] = pid
        return "; the kernel's OOM killer killed it: the host ran out of memory (not the GPU)", details
    named = [w for w in workers if w in killed]
    if named:
        details["dataloader_workers"] = [int(w) for w in named]
        which = f"worker{'s' if len(named) > 1 else ''} (pid {', '.join(named)})"
        return (
            f"; the kernel's OOM killer killed its DataLoader {which}: the host ran out of memory (not the GPU)",
            details,
        )
    if killed_hard or workers:
        whom = "it" if killed_hard and not workers else "its DataLoader worker"
        source = record.get("source") or "the kernel's counter"
        return (
            f"; the kernel's OOM killer killed {kills} process{'es' if kills > 1 else ''} on this host "
            f"during the run ({source}): most likely {whom}, for lack of host memory (not the GPU's)",
            details,
        )
    return None
