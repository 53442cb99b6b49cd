"""Event kinds and the fields each carries (schema version 1).

Every event is one JSON object on one line of `ranks/rank-NNNNN.jsonl` with at least
`v` (schema version), `t` (unix time, float seconds), `rank` (global rank) and `kind`.
Readers must ignore unknown kinds and unknown fields, so new fields never need a version bump;
removing or changing the meaning of a field does.
"""

from __future__ import annotations

from enum import Enum

SCHEMA_VERSION = 1
#: The marker of a state snapshot (`ranks/rank-NNNNN.state`). Events carry only `v`, the version
#: of the event schema (`sddoctor.events/<v>`): a marker string on every line would cost about a
#: tenth of the bytes of a step.
STATE_SCHEMA = f"sddoctor.rank-state/{SCHEMA_VERSION}"


class EventKind(str, Enum):
    """The kinds of rank events. The docstring of each names its usual fields."""

    START = "start"
    """pid, host, local_rank, world_size, device, backend, argv, python, torch."""
    STEP = "step"
    """step, loss, samples, step_time, micro_batch, grad_accum, mem_alloc, mem_peak (bytes), lr,
    images_per_s (the trainer: global images per second of this step)."""
    COLLECTIVE = "collective"
    """Periodic summary: pg, count, seconds, last_seq, ddp_buckets, ddp_bucket_seconds, wait_seconds."""
    OOM = "oom"
    """step, phase (forward|backward|optimizer|probe), micro_batch, grad_accum, mem_alloc, mem_reserved, mem_total, message."""
    FALLBACK = "fallback"
    """step, old_micro_batch, new_micro_batch, old_grad_accum, new_grad_accum, reason, gradient_checkpointing,
    failed_ranks (ranks that ran out of memory), step_applied (whether the failed step was redone)."""
    WARNING = "warning"
    """code, message. The codes sddoctor emits are listed in docs/telemetry.md; a preflight finding
    uses its finding id as code."""
    FAULT = "fault"
    """An injected fault fired: fault (its spec string), seq or step, caller."""
    CHECKPOINT = "checkpoint"
    """step, path, seconds, reason ("periodic"|"end"|"signal SIGTERM"...) when saved;
    action "resume" (and no seconds) when a run resumed from `path`."""
    EXCEPTION = "exception"
    """type, message, traceback (list of "file:line in func"), caller."""
    EXIT = "exit"
    """status (ok|error|signal), code, step."""
    INTERNAL_ERROR = "internal_error"
    """where, type, message, traceback: sddoctor's own code failed inside the rank (recorded once per
    site; the job went on unaffected). Reported as sddoctor's problem, never as the user's."""
    REPLICAS = "replicas"
    """step, params_sha256: a digest of the trained weights at the end of training; equal on every rank
    under DDP (the trainer compares them and warns `replicas_differ` when they are not)."""

    def __str__(self) -> str:  # json.dumps of a str-Enum already writes the value
        return self.value
