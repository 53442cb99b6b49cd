"""Event kinds and the fields each carries (schema version 1).

Every event is one JSON object on one line of `ranks/rank-NNNNN.jsonl` with at least
`v` (schema version), `t` (unix time, float seconds), `rank` (global rank) and `kind`.
Readers must ignore unknown kinds and unknown fields, so new fields never need a version bump;
removing or changing the meaning of a field does.
"""

from __future__ import annotations

from enum import Enum

SCHEMA_VERSION = 1


class EventKind(str, Enum):
    """The kinds of rank events. The docstring of each names its usual fields."""

    START = "start"
    """pid, host, local_rank, world_size, device, backend, argv, python, torch."""
    STEP = "step"
    """step, loss, samples, step_time, micro_batch, grad_accum, mem_alloc, mem_peak (bytes), lr."""
    COLLECTIVE = "collective"
    """Periodic summary: pg, count, seconds, last_seq, ddp_buckets, ddp_bucket_seconds, wait_seconds."""
    OOM = "oom"
    """step, phase (forward|backward|optimizer|probe), micro_batch, grad_accum, mem_alloc, mem_reserved, mem_total, message."""
    FALLBACK = "fallback"
    """step, old_micro_batch, new_micro_batch, old_grad_accum, new_grad_accum, reason, gradient_checkpointing."""
    WARNING = "warning"
    """code, message (e.g. a skipped corrupt image, an NCCL preflight warning)."""
    FAULT = "fault"
    """An injected fault fired: fault (its spec string), seq or step, caller."""
    CHECKPOINT = "checkpoint"
    """step, path, seconds."""
    EXCEPTION = "exception"
    """type, message, traceback (list of "file:line in func"), caller."""
    EXIT = "exit"
    """status (ok|error|signal), code, step."""

    def __str__(self) -> str:  # json.dumps of a str-Enum already writes the value
        return self.value
