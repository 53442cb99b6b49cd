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

from sddoctor import exitcodes
from sddoctor.telemetry import RunDir, new_run_dir
from sddoctor.telemetry.layout import RUN_BASES
from sddoctor.telemetry.redact import redact_argv
from sddoctor.telemetry.runinfo import HANG_TIMEOUT, ON_HANG, STARTUP_TIMEOUT, STRAGGLER_RATIO, RunOptions

RUN_EPILOG = """\
examples:
  sddoctor run -- torchrun --nproc-per-node 4 train.py
  sddoctor run --hang-timeout 60 --on-hang kill -- torchrun --nproc-per-node 2 -m trainer --preset tiny
  sddoctor run -- accelerate launch --num_processes 2 train.py
  sddoctor run --preflight -- torchrun --nproc-per-node 8 train.py    check NCCL/GPUs first
  SDDOCTOR_FAULT='skip:rank=1,seq=12' sddoctor run --hang-timeout 5 -- torchrun --nproc-per-node 2 train.py
  sddoctor run --bind 0.0.0.0 --token-file ~/.sddoctor-token --peers node1:8765 -- torchrun --nnodes 2 ...

The state endpoint (/api/state, /metrics) listens on 127.0.0.1:8765 by default. When 8765 is
taken (a second run on this host) it moves to a free port and says so; a --port you chose that
is taken is an error (exit 2). A --bind other than loopback needs a token (--token-file, or
$SDDOCTOR_TOKEN, or one made and printed at start) or --insecure. Security: SECURITY.md.

{exit_codes}

The report (report.json, report.md) and stacks land in the run directory; `sddoctor report DIR`
prints it again. Details and the report schema: docs/run.md.
""".format(exit_codes=exitcodes.help_block("run"))

#: `--preflight` found a `fail` and nothing was launched
EXIT_PREFLIGHT_FAILED = exitcodes.PREFLIGHT_FAILED
PREFLIGHT_TIMEOUT = 30.0

REPORT_EPILOG = """\
examples:
  sddoctor report sddoctor-runs/run-20261202-101500
  sddoctor report --json runs/my-trainer-run
  sddoctor report --html runs/my-trainer-run       # writes runs/my-trainer-run/report.html
  sddoctor report                      # the latest run under ./sddoctor-runs and ./runs
  sddoctor report --json DIR | jq .verdicts

A run whose supervisor died (kill -9, the OOM killer) is diagnosed from its files, and the
report says when the supervisor was last seen alive.

{exit_codes}
""".format(exit_codes=exitcodes.help_block("report"))


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
    _diagnosis_arguments(p)
    _endpoint_arguments(p)
    p.add_argument(
        "--preflight",
        action="store_true",
        help="run `sddoctor check-nccl --quick` (checks and a short collective test, 30 s limit) before "
        "launching; a `fail` finding stops here (exit 4)",
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


def _diagnosis_arguments(p: argparse.ArgumentParser) -> None:
    """When a run counts as hung or straggling, and what happens on a hang."""
    p.add_argument(
        "--hang-timeout",
        type=_positive,
        default=HANG_TIMEOUT,
        metavar="SECONDS",
        help="no progress (no step, no collective issued or completed) for this long is a hang "
        f"(default {HANG_TIMEOUT:g})",
    )
    p.add_argument(
        "--startup-timeout",
        type=_positive,
        default=STARTUP_TIMEOUT,
        metavar="SECONDS",
        help="allowance for start-up (imports, model loading, rendezvous) before a rank that has issued no "
        f"collective and finished no step counts as hung (default {STARTUP_TIMEOUT:g})",
    )
    p.add_argument(
        "--on-hang",
        choices=("dump", "kill", "wait"),
        default=ON_HANG,
        help="dump: stacks + report, keep waiting (default); kill: dump, then stop the job (exit 124); "
        "wait: report only, no stacks",
    )
    p.add_argument(
        "--straggler-ratio",
        type=_ratio,
        default=STRAGGLER_RATIO,
        metavar="R",
        help="a rank computing R times longer between collectives than the others is a straggler "
        f"(default {STRAGGLER_RATIO:g})",
    )


def _endpoint_arguments(p: argparse.ArgumentParser) -> None:
    """The state endpoint: where it listens, its token, the other nodes' supervisors."""
    from sddoctor.supervise.http import DEFAULT_PORT

    p.add_argument(
        "--port",
        type=_port,
        default=None,
        help=f"port of the state endpoint (/api/state, /metrics); default {DEFAULT_PORT} (a free port "
        "when that is taken), 0 = any free port, -1 = no endpoint",
    )
    p.add_argument(
        "--bind",
        default="127.0.0.1",
        help="address the state endpoint listens on (default 127.0.0.1); any other needs a token or --insecure",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token of the endpoint (first line of FILE; also $SDDOCTOR_TOKEN); give every node of "
        "a --peers job the same one. Without it a non-loopback --bind makes one and prints it once",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --bind without a token (anyone who can reach the port reads the state)",
    )
    p.add_argument(
        "--peers",
        default="",
        help="other nodes' supervisors, host:port,... (this node writes the job report)",
    )


def main(argv: list[str]) -> int:
    """`sddoctor run`."""
    from sddoctor.supervise import launch
    from sddoctor.supervise.supervisor import Options, Supervisor

    parser = run_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    problem = _check_command(command)
    if problem is not None:
        code, message = problem
        print(f"sddoctor run: {message}", file=sys.stderr)
        return code
    try:
        server, note = _bind_endpoint(args)
    except ValueError as exc:
        print(f"sddoctor run: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    try:
        run_dir, lease, token, generated = _claim_run_dir(args, server)
    except ValueError as exc:
        print(f"sddoctor run: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    env, warning = _job_env(run_dir, lease)
    kind = launch.launcher_kind(command)
    preflight_failed = False
    if args.preflight:
        preflight_failed = _preflight(run_dir, quiet=args.quiet)
        # The ranks need not repeat the checks (the bundled trainer runs them at start otherwise).
        env["SDDOCTOR_PREFLIGHT"] = "0"
    run_options = RunOptions(
        hang_timeout=args.hang_timeout,
        startup_timeout=args.startup_timeout,
        straggler_ratio=args.straggler_ratio,
        on_hang=args.on_hang,
    )
    info = _write_run_info(run_dir, args, command, kind, run_options, server, token)
    if preflight_failed and not args.preflight_continue:
        if server is not None:
            server.stop()
        code = _stop_for_preflight(run_dir, info, as_json=args.json)
        lease.end("preflight_failed", code)
        return code
    opts = Options(
        command=command,
        run_dir=run_dir,
        env=env,
        run_info=info,
        run_options=run_options,
        port=None,
        bind=args.bind,
        native=args.native,
        quiet=args.quiet,
        peers=[p.strip() for p in args.peers.split(",") if p.strip()],
        node_rank=info["node_rank"],
        server=server,
        token=token,
    )
    sup = Supervisor(opts)
    for line in (warning, note):
        if line:
            sup.say(line)
    _say_endpoint_access(args, server, run_dir, token, generated)
    try:
        code, report = sup.run()
    except FileNotFoundError as exc:
        lease.end("not_started", exitcodes.NOT_FOUND)
        print(f"sddoctor run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return exitcodes.NOT_FOUND
    lease.end(str(report.get("outcome")), code)
    _print_result(report, run_dir, as_json=args.json)
    return code


def _claim_run_dir(args: argparse.Namespace, server: Any) -> tuple[RunDir, Any, str | None, bool]:
    """(run dir, lease, token, generated): the run directory made or taken over and locked for this
    supervisor, and the endpoint's token. ValueError (the endpoint stopped) when it cannot be."""
    from sddoctor.supervise.rundir_claim import earlier_run, set_aside

    try:
        run_dir = _make_run_dir(args.run_dir)
        earlier = earlier_run(run_dir.path, replace=args.replace)  # refuses a used folder (exit 2)
        lease = _take_lease(run_dir)  # and no other supervisor uses it now (else exit 2)
        if earlier is not None:
            set_aside(run_dir.path, earlier)
        token, generated = _endpoint_token(args, server, run_dir)
    except ValueError:
        if server is not None:
            server.stop()
        raise
    return run_dir, lease, token, generated


def _job_env(run_dir: RunDir, lease: Any) -> tuple[dict[str, str], str | None]:
    """The job's environment and, when the ranks will not be instrumented, the warning saying why."""
    from sddoctor.supervise import launch
    from sddoctor.supervise.http import TOKEN_ENV
    from sddoctor.supervise.lifecycle import job_environment

    env, warning = launch.rank_env(run_dir.path)
    env.pop(TOKEN_ENV, None)  # the ranks need no key to our endpoint
    env.update(job_environment(lease))  # every process of the job watches the supervisor
    return env, warning


def _write_run_info(
    run_dir: RunDir,
    args: argparse.Namespace,
    command: list[str],
    kind: str,
    run_options: RunOptions,
    server: Any,
    token: str | None,
) -> dict[str, Any]:
    """run.json: the command (secrets redacted), where and when it started, the options."""
    from sddoctor.instrument.faults import FAULT_ENV
    from sddoctor.supervise import launch

    info: dict[str, Any] = run_dir.write_run_info(
        schema=RUN_SCHEMA,
        command=redact_argv(command),
        started=time.time(),
        started_iso=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        host=socket.gethostname(),
        launcher=kind,
        world_size=launch.world_size_hint(command),
        node_rank=launch.node_rank_hint(command),
        supervisor_pid=os.getpid(),
        fault=os.environ.get(FAULT_ENV) or None,
        options={
            **run_options.to_dict(),
            "bind": args.bind if server is not None else None,
            "auth": "token" if token else "none",
        },
    )
    return info


def _say_endpoint_access(
    args: argparse.Namespace, server: Any, run_dir: RunDir, token: str | None, generated: bool
) -> None:
    """A token made for this run is shown once; an endpoint open to all off loopback is a warning."""
    if generated:
        _say_always(
            f"[sddoctor] endpoint token (shown once; clients send 'Authorization: Bearer <token>'; "
            f"stored in {run_dir.path / 'endpoint.token'}, mode 0600): {token}"
        )
    elif server is not None and token is None and not _loopback(args.bind):
        _say_always(
            f"[sddoctor] warning: --insecure: anyone who can reach {args.bind}:{server.port} reads the job's state"
        )


RUN_SCHEMA = "sddoctor.run/1"


def _check_command(command: list[str]) -> tuple[int, str] | None:
    """(exit code, message) when the command cannot be run: none, a bad SDDOCTOR_FAULT, no launcher."""
    from sddoctor.instrument.faults import FAULT_ENV, FaultSpecError, check_world, parse_faults
    from sddoctor.supervise import launch

    if not command:
        return exitcodes.USAGE, (
            "no command to run; write it after `--`, e.g. `sddoctor run -- torchrun --nproc-per-node 2 train.py`"
        )
    try:
        check_world(parse_faults(os.environ.get(FAULT_ENV)), launch.world_size_hint(command))
    except FaultSpecError as exc:
        return exitcodes.USAGE, str(exc)
    if launch.resolve_executable(command) is None:
        if os.sep in command[0] and os.path.exists(command[0]):
            return exitcodes.NOT_EXECUTABLE, (
                f"{command[0]!r} exists but cannot be executed; `chmod +x` it or run it through its interpreter"
            )
        return exitcodes.NOT_FOUND, f"command not found: {command[0]!r}; check the spelling or your PATH"
    return None


def _bind_endpoint(args: argparse.Namespace) -> tuple[Any, str | None]:
    """Listen before anything else is created, so a taken port stops the run with nothing to clean up."""
    from sddoctor.supervise.http import DEFAULT_PORT, EndpointError, PortInUse, open_endpoint

    if args.port == -1:
        return None, None
    port = DEFAULT_PORT if args.port is None else args.port
    try:
        return open_endpoint(args.bind, port, explicit=args.port is not None, token=None)
    except PortInUse as exc:
        raise ValueError(
            f"{exc}; choose another with --port N, --port 0 for any free port, or --port -1 for no endpoint"
        ) from None
    except EndpointError as exc:
        raise ValueError(f"--bind {args.bind} --port {port}: {exc}") from None


def _make_run_dir(path: str | None) -> RunDir:
    try:
        if path:
            return RunDir(Path(path).resolve()).ensure()
        return new_run_dir(Path(RUN_BASES[0]).resolve())
    except OSError as exc:
        raise ValueError(f"cannot create the run directory: {exc}; choose another with --run-dir") from None


def _take_lease(run_dir: RunDir) -> Any:
    """Lock the run directory for this supervisor (the job's processes watch the lock)."""
    from sddoctor.supervise.lifecycle import LeaseHeld, SupervisorLease

    try:
        return SupervisorLease(run_dir.path)
    except LeaseHeld as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"cannot write {run_dir.path}: {exc}; choose another --run-dir") from None


def _endpoint_token(args: argparse.Namespace, server: Any, run_dir: RunDir) -> tuple[str | None, bool]:
    """(token, generated): a token is needed off loopback (unless --insecure) and used whenever given."""
    from sddoctor.supervise.http import TOKEN_ENV, EndpointError, endpoint_token

    if server is None:
        return None, False
    given = bool(args.token_file or os.environ.get(TOKEN_ENV, "").strip())
    if not given and (args.insecure or _loopback(args.bind)):
        return None, False
    try:
        token, generated = endpoint_token(run_dir.path, args.token_file)
    except EndpointError as exc:
        raise ValueError(str(exc)) from None
    server.token = token
    return token, generated


def _loopback(host: str) -> bool:
    from sddoctor.supervise.http import is_loopback

    return is_loopback(host)


def _say_always(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


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
        "schema": "sddoctor.preflight/1",
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
    from sddoctor.supervise.report import REPORT_SCHEMA, REPORT_VERSION, attach_preflight, write_report

    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
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


def _report_run_dir(prog: str, given: str | None) -> tuple[RunDir | None, str | None]:
    """(run dir, None) or (None, the one-line problem): the one named, else the latest one."""
    from sddoctor.telemetry import find_latest_run
    from sddoctor.telemetry.reader import unreadable

    if given is None:
        try:
            found = find_latest_run(*RUN_BASES)
        except OSError as exc:
            return None, f"cannot look for runs here: {exc}; give one: {prog} DIR"
        if found is None:
            return None, f"no run directory found under ./sddoctor-runs or ./runs; give one: {prog} DIR"
        run_dir = found
    else:
        run_dir = RunDir(given)
    problem = unreadable(run_dir.path)
    if problem is not None:
        return None, problem
    if not run_dir.path.is_dir():
        return None, f"{given!r} is not a directory; give a run directory (one with run.json or ranks/)"
    return run_dir, None


def _load_report(run_dir: RunDir, rediagnose: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(report, None): report.json, or a diagnosis of the files when there is none (or when
    `rediagnose`); (None, the one-line problem) when the folder holds nothing to diagnose."""
    from sddoctor.supervise.offline import diagnose_run_dir, load_report

    report = None if rediagnose else load_report(run_dir)
    if report is not None:
        return report, None
    if not run_dir.ranks_dir.is_dir() and not run_dir.run_json.exists():
        return (
            None,
            f"{run_dir.path} has no report.json, run.json or ranks/: not a sddoctor or trainer run directory",
        )
    try:
        return diagnose_run_dir(run_dir), None
    except Exception as exc:  # noqa: BLE001 - telemetry that the readers let through and the diagnosis cannot use
        if os.environ.get("SDDOCTOR_DEBUG"):
            raise
        return None, (
            f"cannot diagnose {run_dir.path}: its telemetry is not what sddoctor writes "
            f"({type(exc).__name__}: {exc}); SDDOCTOR_DEBUG=1 shows where"
        )


def _run_dir_and_report(
    prog: str, given: str | None, rediagnose: bool
) -> tuple[RunDir, dict[str, Any]] | None:
    """The run directory and its report; None after saying in one line why there is none."""
    run_dir, problem = _report_run_dir(prog, given)
    if run_dir is not None:
        report, problem = _load_report(run_dir, rediagnose)
        if report is not None:
            return run_dir, report
    print(f"{prog}: {problem}", file=sys.stderr)
    return None


def report_main(argv: list[str]) -> int:
    """`sddoctor report`."""
    from sddoctor.supervise.lifecycle import describe, lease_status
    from sddoctor.supervise.report import attach_health, render_markdown, render_summary, write_html
    from sddoctor.telemetry.validate import PROBLEMS

    prog = "sddoctor report"
    args = report_parser().parse_args(argv)
    if args.output and not args.html:
        print(f"{prog}: --output goes with --html", file=sys.stderr)
        return exitcodes.USAGE
    found = _run_dir_and_report(prog, args.run_dir, args.rediagnose)
    if found is None:
        return exitcodes.USAGE
    run_dir, report = found
    supervisor = lease_status(run_dir.path)
    if supervisor is not None:
        report["supervisor"] = supervisor
    if args.html or (args.markdown and "health" not in report):
        data = attach_health(report, run_dir)
        if args.html:
            target = Path(args.output) if args.output else run_dir.report_html
            trouble = "cannot read the run directory" if data is None else write_html(data, target)
            if trouble:
                print(f"{prog}: cannot write {target}: {trouble}", file=sys.stderr)
                return exitcodes.USAGE
            print(f"{prog}: wrote {target}", file=sys.stderr)
    warning = PROBLEMS.summary()
    if warning:
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.markdown:
        died = [line.strip() for line in describe(supervisor)]
        print(render_markdown(report) + "".join(f"\n## Supervisor\n\n{line}\n" for line in died))
    else:
        print("\n".join([render_summary(report, str(run_dir.path)), *describe(supervisor)]))
    errors = [v for v in report.get("verdicts") or [] if v.get("severity") == "error"]
    failed = errors or report.get("outcome") == "preflight_failed"
    return exitcodes.FINDINGS if failed else exitcodes.OK


TRACE_EPILOG = """\
examples:
  sddoctor trace sddoctor-runs/run-20261202-101500 -o trace.json    then open it in ui.perfetto.dev
  sddoctor trace                       # the latest run; writes RUN_DIR/trace.json
  sddoctor trace --last 120 RUN_DIR    # only the last two minutes

Each rank is a process with tracks for its steps, its collectives (with the time it waited for
the last rank to arrive) and its events (OOM, fallback, fault, exception, exit, the hang), plus
counters (step time, loss, GPU utilisation and memory). Details: docs/run.md.

{exit_codes}
""".format(exit_codes=exitcodes.help_block("trace"))


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

    prog = "sddoctor trace"
    args = trace_parser().parse_args(argv)
    found = _run_dir_and_report(prog, args.run_dir, rediagnose=False)
    if found is None:
        return exitcodes.USAGE
    run_dir, report = found
    target = Path(args.output) if args.output else run_dir.path / "trace.json"
    data = RunData.load(run_dir, report)
    try:
        trace = write_trace(data, str(target), args.last)
    except OSError as exc:
        print(f"{prog}: cannot write {target}: {exc}; choose another path with -o", file=sys.stderr)
        return exitcodes.USAGE
    events = trace["traceEvents"]
    slices = sum(1 for e in events if e.get("ph") == "X")
    print(
        f"{prog}: wrote {target} ({len(data.timeline.lanes)} ranks, {slices} slices); open it in https://ui.perfetto.dev",
        file=sys.stderr,
    )
    return exitcodes.OK
