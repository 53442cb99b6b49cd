"""The `sddoctor` entry point. It only dispatches: each subcommand lives in its own module,
imported when chosen, so `sddoctor --help` (and `tui`, `report`) start without importing torch.
"""

from __future__ import annotations

import importlib
import sys

from sddoctor import __version__

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
"""


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in SUBCOMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"sddoctor {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"sddoctor: unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"sddoctor {name}: cannot load {module_name}: {exc}", file=sys.stderr)
        return 3
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
