"""`sddoctor tui`: argument parsing, and the `--once` / `--json` paths that never start the UI.

Textual is imported only when the live view starts, so `--once` and `--json` stay fast, and
nothing here imports torch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sddoctor import exitcodes

if TYPE_CHECKING:  # imported where used: the screen's start-up time counts
    from sddoctor.gpu.collector import Collector
    from sddoctor.ranks.feeds import RankFeed
    from sddoctor.telemetry.registry import LiveRun

EXIT_OK = exitcodes.OK
EXIT_USAGE = exitcodes.USAGE
JSON_SCHEMA = "sddoctor.tui/1"

DESCRIPTION = """\
Live, rank-aware GPU monitor: local GPUs (NVML) and their processes, the host, and the ranks
of a DDP run (step, loss, it/s, images/s, which collective each rank waits in, verdicts of
`sddoctor run`). Without NVML or a GPU it still shows host and rank data.
"""

EPILOG = """\
examples:
  sddoctor tui                                  # local GPUs + your running `sddoctor run` (a list
                                                #   to pick from if several), else the newest run in
                                                #   ./sddoctor-runs or ./runs
  sddoctor tui --run-dir sddoctor-runs/run-20261202-101500
  sddoctor tui --connect node0:8765 --connect node1:8765   # several nodes in one view
  sddoctor tui --once                           # one text snapshot, no UI
  sddoctor tui --json | jq '.gpus[].utilization_gpu'

keys: ? help, s sort, / filter, enter rank details and stack dump, p pause, r pick a live run, q quit

{exit_codes}
""".format(exit_codes=exitcodes.help_block("tui"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sddoctor tui",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", metavar="DIR", help="run directory to read rank telemetry from")
    p.add_argument(
        "--connect",
        metavar="HOST:PORT",
        action="append",
        default=[],
        help="`sddoctor run` state endpoint to poll (repeat for several nodes)",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="GPU sampling period (default 1)"
    )
    p.add_argument(
        "--pcie-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="PCIe throughput sampling period, in a background thread (0 turns it off; default 5)",
    )
    p.add_argument(
        "--no-run", action="store_true", help="do not look for a run directory; GPUs and host only"
    )
    p.add_argument("--once", action="store_true", help="print one snapshot as text and exit (no UI)")
    p.add_argument(
        "--json", action="store_true", help="print one snapshot as JSON and exit (schema in docs/tui.md)"
    )
    return p


def _fail(message: str) -> int:
    print(f"sddoctor tui: {message}", file=sys.stderr)
    return EXIT_USAGE


def _check_endpoint(text: str) -> str | None:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return f"{host}:{int(port)}"


def make_feed(args: argparse.Namespace, live: list[LiveRun] | None = None) -> RankFeed | None:
    """The rank feed the arguments ask for (None: no run). Raises ValueError with a user message.

    With neither --run-dir, --connect nor --no-run: the one live run of this user on this host
    (`live`, from the registry), all of them when there are several, else the newest run
    directory under ./sddoctor-runs or ./runs.
    """
    from sddoctor.ranks.feeds import HttpFeed, MultiFeed, RunDirFeed
    from sddoctor.telemetry import find_latest_run
    from sddoctor.telemetry.layout import RUN_BASES
    from sddoctor.telemetry.reader import unreadable

    feeds: list[RankFeed] = []
    if args.run_dir:
        path = Path(args.run_dir)
        if not path.is_dir():
            raise ValueError(
                f"--run-dir {args.run_dir}: no such directory; pass a run directory such as ./sddoctor-runs/run-..."
            )
        problem = unreadable(path)
        if problem is not None:
            raise ValueError(f"--run-dir: {problem}")
        feeds.append(RunDirFeed(path))
    for ep in args.connect:
        checked = _check_endpoint(ep)
        if checked is None:
            raise ValueError(f"--connect {ep!r}: expected HOST:PORT, for example --connect 127.0.0.1:8765")
        feeds.append(HttpFeed(checked))
    if not feeds and not args.no_run and live:
        feeds += [RunDirFeed(run.run_dir, job_dir=run.cwd) for run in live]
    if not feeds and not args.no_run:
        latest = find_latest_run(*RUN_BASES)
        if latest is not None:
            feeds.append(RunDirFeed(latest))
    if not feeds:
        return None
    return feeds[0] if len(feeds) == 1 else MultiFeed(feeds)


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the problem
        return int(exc.code or 0) if exc.code in (0, None) else EXIT_USAGE
    if not args.interval > 0:
        return _fail(f"--interval {args.interval}: must be a positive number of seconds, e.g. --interval 1")
    if args.pcie_interval < 0:
        return _fail("--pcie-interval must be 0 (off) or a positive number of seconds")

    from sddoctor.gpu.source import NvmlSource

    # Opening NVML (~0.1 s on an 8-GPU host, mostly inside the driver) runs on its own thread
    # from here on, overlapping the imports below (Textual alone takes ~0.2 s); only the
    # sampling thread ever waits for it, never the UI.
    source = NvmlSource(
        pcie_interval=0 if args.once or args.json else args.pcie_interval, open_in_background=True
    )
    live = []
    if not (args.run_dir or args.connect or args.no_run):
        from sddoctor.telemetry.registry import live_runs

        live = live_runs()
    # Several live runs: the live view asks which one to watch; --once and --json show them all.
    pick = live if len(live) > 1 and not (args.once or args.json) else None
    try:
        feed = None if pick else make_feed(args, live)
    except ValueError as exc:
        source.close()
        return _fail(str(exc))

    from sddoctor.gpu.collector import Collector

    if args.once or args.json:
        return print_once(Collector(source), feed, as_json=args.json)

    # Importing Textual and the app creates ~50k objects that live as long as the process; the
    # cyclic garbage collector would walk them again and again during start-up (about 30 ms of
    # CPU before the first frame here). It is off while they are created; they are then frozen
    # out of its sight.
    gc.disable()
    try:
        from sddoctor.tui.app import MonitorApp
    finally:
        gc.freeze()
        gc.enable()

    app = MonitorApp(Collector(source), feed, interval=args.interval, pick_runs=pick)
    app.run()
    return EXIT_OK


#: psutil's CPU percentages need two readings; --once waits this long after the first.
ONCE_CPU_WINDOW = 0.1


def print_once(collector: Collector, feed: RankFeed | None, as_json: bool) -> int:
    from sddoctor.ranks.feeds import RankReport
    from sddoctor.ranks.overview import Overview
    from sddoctor.telemetry.validate import PROBLEMS

    started = time.perf_counter()
    collector.sample()  # primes CPU counters of the GPU processes
    try:
        report = feed.poll() if feed is not None else RankReport()
    except Exception as exc:  # noqa: BLE001 - telemetry the readers let through and the view cannot use
        if os.environ.get("SDDOCTOR_DEBUG"):
            raise
        collector.close()
        return _fail(
            f"cannot read the run's telemetry ({type(exc).__name__}: {exc}); SDDOCTOR_DEBUG=1 shows where"
        )
    warning = PROBLEMS.summary()
    if warning:
        print(f"sddoctor tui: warning: {warning}", file=sys.stderr)
    time.sleep(max(0.0, ONCE_CPU_WINDOW - (time.perf_counter() - started)))
    ov = Overview.build(collector.sample(), report)
    collector.close()
    if as_json:
        print(json.dumps({"schema": JSON_SCHEMA, **ov.to_dict()}, indent=2))
    else:
        from sddoctor.tui.text import render_text

        print(render_text(ov))
    return EXIT_OK
