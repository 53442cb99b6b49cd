"""The `sddoctor` entry point. It only dispatches: each subcommand lives in its own module,
imported when chosen, so `sddoctor --help` (and `tui`, `report`) start without importing torch.
"""

from __future__ import annotations

import importlib
import os
import sys

from sddoctor import __version__, exitcodes

#: name -> (module:function, one-line summary). The function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "sddoctor.supervise.cli:main",
        "run a DDP job under supervision; explain hangs, crashes, stragglers, OOMs",
    ),
    "report": (
        "sddoctor.supervise.cli:report_main",
        "print the diagnosis of a run directory again (--html: the report page)",
    ),
    "trace": (
        "sddoctor.supervise.cli:trace_main",
        "export a run's per-rank timeline as a Perfetto/Chrome trace",
    ),
    "check-nccl": (
        "sddoctor.preflight.cli:main",
        "preflight GPUs, topology, NCCL settings and network; bandwidth test",
    ),
    "tui": ("sddoctor.tui.cli:main", "live, rank-aware GPU monitor"),
}

USAGE = """\
usage: sddoctor [-h] [--version] <command> [args...]

Diagnose multi-GPU Stable Diffusion (PyTorch DDP) training.

commands:
{commands}

examples:
  sddoctor run -- torchrun --nproc-per-node 2 -m trainer --preset tiny
  sddoctor run --hang-timeout 60 -- torchrun --nproc-per-node 4 train.py
  sddoctor report sddoctor-runs/run-20261202-101500
  sddoctor trace sddoctor-runs/run-20261202-101500 -o trace.json
  sddoctor check-nccl --quick
  sddoctor tui

Run `sddoctor <command> --help` for a command's options and exit codes.
The bundled trainer runs as `python -m trainer` (see `python -m trainer --help`).

{exit_codes}
"""


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return USAGE.format(commands="\n".join(lines), exit_codes=exitcodes.help_block("sddoctor"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return pipe_closed()
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return exitcodes.OK if argv else exitcodes.USAGE
    if argv[0] == "--version":
        print(f"sddoctor {__version__}")
        return exitcodes.OK
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"sddoctor: unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return exitcodes.USAGE
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = f" (pip install {exc.name})" if getattr(exc, "name", None) else ""
        print(f"sddoctor {name}: cannot load {module_name}: {exc}{missing}", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except (BrokenPipeError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if os.environ.get("SDDOCTOR_DEBUG"):
            raise
        _say(
            f"sddoctor {name}: internal error: {type(exc).__name__}: {exc}. This is a bug in sddoctor; "
            "SDDOCTOR_DEBUG=1 shows the traceback"
        )
        return exitcodes.INTERNAL


def pipe_closed() -> int:
    """The reader of stdout went away (`sddoctor report | head -1`): stop quietly, as Unix tools do.

    stdout is pointed at /dev/null so that Python's own flush at exit does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return exitcodes.PIPE_CLOSED


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
