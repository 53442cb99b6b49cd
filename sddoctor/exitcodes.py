"""One exit-code table for every `sddoctor` command (docs/exit-codes.md shows the same table).

A number means the same thing wherever it appears. `sddoctor run` also passes the job's own exit
code through (as `timeout` and `nohup` do), so for `run` any code may come from the job: its
report.json (`outcome`, `exit_code`, `job_exit_code`) tells which.
Stdlib only: `sddoctor --help` imports it.
"""

from __future__ import annotations

OK = 0
#: an error-level finding: a hang, crash, OOM or diverged replicas in a report; a `fail` in check-nccl
FINDINGS = 1
#: bad option or value, or input that cannot be used (run directory, telemetry, SDDOCTOR_FAULT, port)
USAGE = 2
#: check-nccl: warnings, no failure
WARNINGS = 3
#: run --preflight found a `fail`; nothing was launched
PREFLIGHT_FAILED = 4
#: a part of sddoctor cannot be loaded (a dependency is missing or broken)
UNAVAILABLE = 5
#: sddoctor itself failed (a bug); SDDOCTOR_DEBUG=1 shows the traceback
INTERNAL = 70
#: run: the job hung and was stopped (--on-hang kill)
HANG_KILLED = 124
#: run: the launcher exists but cannot be executed
NOT_EXECUTABLE = 126
#: run: the launcher command was not found
NOT_FOUND = 127
#: interrupted: 128 + the signal (Ctrl-C 130, SIGTERM 143, SIGHUP 129)
INTERRUPTED = 130
#: the reader of our output went away (`sddoctor report | head -1`), as for any Unix tool
PIPE_CLOSED = 141

#: (code, commands, meaning), in order
TABLE: list[tuple[str, str, str]] = [
    ("0", "all", "success: the job succeeded, nothing wrong was found"),
    (
        "1",
        "run, report, check-nccl",
        "an error-level finding (report: hang, crash, OOM, diverged replicas, or a failed --preflight; "
        "check-nccl: a failure, including a hung or crashed collective test; run: a rank crashed "
        "although the job's command ended 0)",
    ),
    (
        "2",
        "all",
        "usage error: bad option or value, or input that cannot be used (no such run directory, "
        "unreadable or garbled telemetry, malformed SDDOCTOR_FAULT, endpoint port taken)",
    ),
    ("3", "check-nccl", "warnings, and no failure"),
    ("4", "run", "--preflight found a failure; nothing was launched (--preflight-continue launches anyway)"),
    ("5", "all", "a part of sddoctor cannot be loaded (a dependency is missing); the message names it"),
    ("70", "all", "sddoctor itself failed (a bug): one line says what; SDDOCTOR_DEBUG=1 shows the traceback"),
    ("124", "run", "the job hung and sddoctor stopped it (--on-hang kill)"),
    ("126", "run", "the launcher command exists but cannot be executed"),
    ("127", "run", "the launcher command was not found"),
    (
        "128+S",
        "all",
        "interrupted by signal S: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (run: also the launcher killed by S)",
    ),
    ("141", "all", "the reader of the output went away (piped into `head`); sddoctor stops quietly"),
    ("N", "run", "any other code is the job's own exit code"),
]


def help_block(command: str) -> str:
    """The `exit codes:` part of a command's --help: the rows of the table that apply to it
    (`sddoctor --help`: every row, with the commands it applies to)."""
    import textwrap

    everything = command == "sddoctor"
    rows = [
        (code, f"{text} [{where}]" if everything and where != "all" else text)
        for code, where, text in TABLE
        if everything or where == "all" or command in where.split(", ")
    ]
    width = max(len(code) for code, _ in rows)
    lines = ["exit codes (one table for every sddoctor command: docs/exit-codes.md):"]
    for code, text in rows:
        lines += textwrap.wrap(
            text, 100, initial_indent=f"  {code.ljust(width)}  ", subsequent_indent=" " * (width + 4)
        )
    return "\n".join(lines)
