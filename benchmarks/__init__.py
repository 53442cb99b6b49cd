"""Benchmarks of sddoctor's own cost (not part of the installed package; run from a checkout).

    python -m benchmarks.instrument_overhead   the rank-side instrumentation on vs off (docs/telemetry.md#overhead)
    python -m benchmarks.tui_cost              `sddoctor tui`'s sampling, rendering and start-up (docs/tui.md)

The trainer's own speed benchmark is a command of the trainer: `python -m trainer.bench`
(docs/performance.md).
"""
