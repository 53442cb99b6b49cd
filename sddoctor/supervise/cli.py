"""`sddoctor run` and `sddoctor report`: argument parsing and glue. Neither imports torch."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sddoctor.telemetry import RunDir, new_run_dir

RUN_EPILOG = """\
examples:
  sddoctor run -- torchrun --nproc-per-node 4 train.py
  sddoctor run --hang-timeout 60 --on-hang kill -- torchrun --nproc-per-node 2 -m trainer --preset tiny
  sddoctor run -- accelerate launch --num_processes 2 train.py
  sddoctor run --preflight -- torchrun --nproc-per-node 8 train.py    check NCCL/GPUs first
  SDDOCTOR_FAULT='skip:rank=1,seq=12' sddoctor run --hang-timeout 5 -- torchrun --nproc-per-node 2 train.py
  sddoctor run --port 8765 --peers node1:8765 -- torchrun --nnodes 2 --node-rank 0 ...

exit codes:
  0     the job succeeded
  N     the job's own exit code (128+S when the launcher died of signal S)
  2     usage error (bad option, no command, malformed SDDOCTOR_FAULT, unusable --run-dir)
  3     --preflight found a `fail` and the job was not launched (--preflight-continue launches anyway)
  124   sddoctor killed the job because it hung (--on-hang kill)
  127   the launcher command was not found
  130   interrupted (Ctrl-C); 143 on SIGTERM

The report (report.json, report.md) and stacks land in the run directory; `sddoctor report DIR`
prints it again. Details and the report schema: docs/run.md.
"""

#: open run-directory locks (see rundir_lock): referenced so that they stay held
_HELD_LOCKS: list[Any] = []
#: `--preflight` found a `fail` and nothing was launched
EXIT_PREFLIGHT_FAILED = 3
PREFLIGHT_TIMEOUT = 30.0

REPORT_EPILOG = """\
examples:
  sddoctor report sddoctor-runs/run-20261202-101500
  sddoctor report --json runs/my-trainer-run
  sddoctor report --html runs/my-trainer-run       # writes runs/my-trainer-run/report.html
  sddoctor report                      # the latest run under ./sddoctor-runs and ./runs

exit codes:
  0   report printed; no error-level finding
  1   report printed; at least one error-level finding (hang, crash, OOM, diverged replicas), or
      a `sddoctor run --preflight` that failed and launched nothing
  2   usage error: no such run directory, or nothing in it to diagnose; --html could not write
"""


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def _ratio(text: str) -> float:
    value = _positive(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 1 (e.g. 2 = twice the others)")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"port {value} is out of range (0-65535, 0 = any free port, -1 = off)"
        )
    return value


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sddoctor run",
        description="Run a distributed job under supervision; explain hangs, crashes, stragglers and OOMs.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", help="run directory (default: a new folder under ./sddoctor-runs/)")
    p.add_argument(
        "--replace",
        action="store_true",
        help="--run-dir holds an earlier run: move its telemetry to RUN_DIR/replaced/<time>/ and use the "
        "folder (without it such a folder is refused, exit 2)",
    )
    p.add_argument(
        "--hang-timeout",
        type=_positive,
        default=300.0,
        metavar="SECONDS",
        help="no progress (no step, no collective issued or completed) for this long is a hang (default 300)",
    )
    p.add_argument(
        "--startup-timeout",
        type=_positive,
        default=900.0,
        metavar="SECONDS",
        help="allowance for start-up (imports, model loading, rendezvous) before a rank that has issued no "
        "collective and finished no step counts as hung (default 900)",
    )
    p.add_argument(
        "--on-hang",
        choices=("dump", "kill", "wait"),
        default="dump",
        help="dump: stacks + report, keep waiting (default); kill: dump, then stop the job (exit 124); "
        "wait: report only, no stacks",
    )
    p.add_argument(
        "--straggler-ratio",
        type=_ratio,
        default=2.0,
        metavar="R",
        help="a rank computing R times longer between collectives than the others is a straggler (default 2)",
    )
    p.add_argument(
        "--port",
        type=_port,
        default=0,
        help="port of the state endpoint (/api/state, /metrics); 0 = any free port (default), -1 = off",
    )
    p.add_argument(
        "--bind", default="127.0.0.1", help="address the state endpoint listens on (default 127.0.0.1)"
    )
    p.add_argument(
        "--peers",
        default="",
        help="other nodes' supervisors, host:port,... (this node writes the job report)",
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="run `sddoctor check-nccl --quick` (checks and a short collective test, 30 s limit) before "
        "launching; a `fail` finding stops here (exit 3)",
    )
    p.add_argument(
        "--preflight-continue",
        action="store_true",
        help="with --preflight: launch even when a finding is `fail`",
    )
    p.add_argument("--native", action="store_true", help="include native frames in stack dumps (slower)")
    p.add_argument("--json", action="store_true", help="print the final report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress lines; only the final summary")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    return p


def main(argv: list[str]) -> int:
    """`sddoctor run`."""
    from sddoctor.instrument.faults import FAULT_ENV, FaultSpecError, parse_faults
    from sddoctor.supervise import launch
    from sddoctor.supervise.rundir_lock import RunDirBusy, lock_run_dir
    from sddoctor.supervise.supervisor import EXIT_NOT_FOUND, EXIT_USAGE, Options, Supervisor

    parser = run_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "sddoctor run: no command to run; write it after `--`, e.g. "
            "`sddoctor run -- torchrun --nproc-per-node 2 train.py`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        parse_faults(os.environ.get(FAULT_ENV))
    except FaultSpecError as exc:
        print(f"sddoctor run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if launch.resolve_executable(command) is None:
        print(
            f"sddoctor run: command not found: {command[0]!r}; check the spelling or your PATH",
            file=sys.stderr,
        )
        return EXIT_NOT_FOUND
    try:
        if args.run_dir:
            run_dir = RunDir(Path(args.run_dir).resolve())
        else:
            run_dir = new_run_dir(Path("sddoctor-runs").resolve())
        # held for the life of this process (the kernel releases it however the process ends)
        _HELD_LOCKS.append(lock_run_dir(run_dir.path, replace=args.replace))
        run_dir.ensure()
    except RunDirBusy as exc:
        print(f"sddoctor run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(
            f"sddoctor run: cannot create the run directory: {exc}; choose another with --run-dir",
            file=sys.stderr,
        )
        return EXIT_USAGE
    env, warning = launch.rank_env(run_dir.path)
    kind = launch.launcher_kind(command)
    preflight_failed = False
    if args.preflight:
        preflight_failed = _preflight(run_dir, quiet=args.quiet)
        # The ranks need not repeat the checks (the bundled trainer runs them at start otherwise).
        env["SDDOCTOR_PREFLIGHT"] = "0"
    info: dict[str, Any] = run_dir.write_run_info(
        command=command,
        started=time.time(),
        started_iso=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        host=socket.gethostname(),
        launcher=kind,
        world_size=launch.world_size_hint(command),
        node_rank=launch.node_rank_hint(command),
        supervisor_pid=os.getpid(),
        fault=os.environ.get(FAULT_ENV) or None,
        options={
            "hang_timeout": args.hang_timeout,
            "startup_timeout": args.startup_timeout,
            "on_hang": args.on_hang,
            "straggler_ratio": args.straggler_ratio,
        },
    )
    if preflight_failed and not args.preflight_continue:
        return _stop_for_preflight(run_dir, info, as_json=args.json)
    opts = Options(
        command=command,
        run_dir=run_dir,
        env=env,
        run_info=info,
        hang_timeout=args.hang_timeout,
        startup_timeout=args.startup_timeout,
        on_hang=args.on_hang,
        straggler_ratio=args.straggler_ratio,
        port=None if args.port == -1 else args.port,
        bind=args.bind,
        native=args.native,
        quiet=args.quiet,
        peers=[p.strip() for p in args.peers.split(",") if p.strip()],
        node_rank=info["node_rank"],
    )
    sup = Supervisor(opts)
    if warning:
        sup.say(warning)
    try:
        code, report = sup.run()
    except FileNotFoundError as exc:
        print(f"sddoctor run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    _print_result(report, run_dir, as_json=args.json)
    return code


def _preflight(run_dir: RunDir, *, quiet: bool) -> bool:
    """`check-nccl --quick` before the launch: print the findings, save RUN_DIR/preflight.json.
    True when a finding is `fail`."""
    from sddoctor.preflight import format_findings, run_preflight
    from sddoctor.preflight.findings import worst_severity
    from sddoctor.supervise.report import PREFLIGHT_FILE

    if not quiet:
        print("[sddoctor] preflight: checks and a short collective test (at most 30 s) ...", file=sys.stderr)
    t0 = time.time()
    findings = run_preflight(quick=True, collective=True, timeout=PREFLIGHT_TIMEOUT)
    worst = worst_severity(findings)
    record = {
        "v": 1,
        "t": t0,
        "seconds": round(time.time() - t0, 2),
        "worst": worst,
        "findings": [f.to_dict() for f in findings],
    }
    (run_dir.path / PREFLIGHT_FILE).write_text(json.dumps(record, indent=2))
    shown = [f for f in findings if f.severity in ("warn", "fail")]
    if shown:
        print(format_findings(shown, min_severity="warn"), file=sys.stderr)
    if not quiet or shown:
        print(
            f"[sddoctor] preflight: {worst} ({len(findings)} checks, {record['seconds']} s); "
            f"details in {run_dir.path / PREFLIGHT_FILE}",
            file=sys.stderr,
            flush=True,
        )
    return worst == "fail"


def _stop_for_preflight(run_dir: RunDir, info: dict[str, Any], *, as_json: bool) -> int:
    """Write a report that says why nothing was launched; exit EXIT_PREFLIGHT_FAILED."""
    from sddoctor.supervise.report import attach_preflight, write_report

    report: dict[str, Any] = {
        "schema": "sddoctor.report",
        "version": 1,
        "generated": time.time(),
        "run": info,
        "outcome": "preflight_failed",
        "exit_code": EXIT_PREFLIGHT_FAILED,
        "job_exit_code": None,
        "verdicts": [],
        "ranks": {},
    }
    attach_preflight(report, run_dir)
    write_report(run_dir, report)
    print(
        "sddoctor run: the preflight found a failure (above); the job was not launched. Fix it, or "
        "launch anyway with --preflight-continue.",
        file=sys.stderr,
    )
    _print_result(report, run_dir, as_json=as_json)
    return EXIT_PREFLIGHT_FAILED


def _print_result(report: dict[str, Any], run_dir: RunDir, *, as_json: bool) -> None:
    from sddoctor.supervise.report import render_summary

    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_summary(report, str(run_dir.path)), file=sys.stderr)


def _run_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir", nargs="?", help="run directory (default: the latest under ./sddoctor-runs or ./runs)"
    )


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sddoctor report",
        description="Print the diagnosis of a run directory (diagnosing it now if it has no report yet).",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _run_dir_argument(p)
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary")
    p.add_argument("--markdown", action="store_true", help="print report.md instead of the summary")
    p.add_argument(
        "--rediagnose", action="store_true", help="diagnose the run directory again even if it has a report"
    )
    p.add_argument(
        "--html",
        action="store_true",
        help="write report.html (verdict, per-rank timeline, plots, stacks; one self-contained file) and print its path",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="with --html: write the page here instead of RUN_DIR/report.html",
    )
    return p


def _find_run_dir(prog: str, given: str | None) -> RunDir | None:
    """The run directory named on the command line, else the latest one; None (after saying why) if none."""
    from sddoctor.telemetry import find_latest_run

    if given:
        run_dir = RunDir(given)
        if not run_dir.path.is_dir():
            print(
                f"{prog}: {given!r} is not a directory; give a run directory (one with run.json or ranks/)",
                file=sys.stderr,
            )
            return None
        return run_dir
    found = find_latest_run("sddoctor-runs", "runs")
    if found is None:
        print(
            f"{prog}: no run directory found under ./sddoctor-runs or ./runs; give one: {prog} DIR",
            file=sys.stderr,
        )
    return found


def _load_report(prog: str, run_dir: RunDir, rediagnose: bool) -> dict[str, Any] | None:
    """report.json, or a diagnosis of the files when there is none (or `rediagnose`); None if not a run dir."""
    from sddoctor.supervise.offline import diagnose_run_dir
    from sddoctor.telemetry import read_json

    report = None if rediagnose else read_json(run_dir.report_json)
    if report is None:
        if not run_dir.ranks_dir.is_dir() and not run_dir.run_json.exists():
            print(
                f"{prog}: {run_dir.path} has no report.json, run.json or ranks/: "
                "not a sddoctor or trainer run directory",
                file=sys.stderr,
            )
            return None
        report = diagnose_run_dir(run_dir)
    return report


def report_main(argv: list[str]) -> int:
    """`sddoctor report`."""
    from sddoctor.supervise.report import attach_health, render_markdown, render_summary, write_html

    args = report_parser().parse_args(argv)
    if args.output and not args.html:
        print("sddoctor report: --output goes with --html", file=sys.stderr)
        return 2
    run_dir = _find_run_dir("sddoctor report", args.run_dir)
    if run_dir is None:
        return 2
    report = _load_report("sddoctor report", run_dir, args.rediagnose)
    if report is None:
        return 2
    if args.html or (args.markdown and "health" not in report):
        data = attach_health(report, run_dir)
        if args.html:
            target = Path(args.output) if args.output else run_dir.report_html
            problem = "cannot read the run directory" if data is None else write_html(data, target)
            if problem:
                print(f"sddoctor report: cannot write {target}: {problem}", file=sys.stderr)
                return 2
            print(f"sddoctor report: wrote {target}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.markdown:
        print(render_markdown(report))
    else:
        print(render_summary(report, str(run_dir.path)))
    errors = [v for v in report.get("verdicts") or [] if v.get("severity") == "error"]
    return 1 if errors or report.get("outcome") == "preflight_failed" else 0


TRACE_EPILOG = """\
examples:
  sddoctor trace sddoctor-runs/run-20261202-101500 -o trace.json    then open it in ui.perfetto.dev
  sddoctor trace                       # the latest run; writes RUN_DIR/trace.json
  sddoctor trace --last 120 RUN_DIR    # only the last two minutes

Each rank is a process with tracks for its steps, its collectives (with the time it waited for
the last rank to arrive) and its events (OOM, fallback, fault, exception, exit, the hang), plus
counters (step time, loss, GPU utilisation and memory). Details: docs/run.md.

exit codes:
  0   trace written
  2   usage error: no such run directory, nothing in it, or the output cannot be written
"""


def trace_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sddoctor trace",
        description="Export a run directory as a Chrome/Perfetto trace (JSON trace event format).",
        epilog=TRACE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _run_dir_argument(p)
    p.add_argument(
        "-o", "--output", metavar="PATH", help="where to write the trace (default RUN_DIR/trace.json)"
    )
    p.add_argument(
        "--last",
        type=_positive,
        metavar="SECONDS",
        help="only the last SECONDS of the run (a long run's whole record can be a large file)",
    )
    return p


def trace_main(argv: list[str]) -> int:
    """`sddoctor trace`."""
    from sddoctor.supervise.rundata import RunData
    from sddoctor.supervise.trace import write_trace

    args = trace_parser().parse_args(argv)
    run_dir = _find_run_dir("sddoctor trace", args.run_dir)
    if run_dir is None:
        return 2
    report = _load_report("sddoctor trace", run_dir, rediagnose=False)
    if report is None:
        return 2
    target = Path(args.output) if args.output else run_dir.path / "trace.json"
    data = RunData.load(run_dir, report)
    try:
        trace = write_trace(data, str(target), args.last)
    except OSError as exc:
        print(f"sddoctor trace: cannot write {target}: {exc}; choose another path with -o", file=sys.stderr)
        return 2
    events = trace["traceEvents"]
    slices = sum(1 for e in events if e.get("ph") == "X")
    print(
        f"sddoctor trace: wrote {target} ({len(data.timeline.lanes)} ranks, {slices} slices); "
        "open it in https://ui.perfetto.dev",
        file=sys.stderr,
    )
    return 0
