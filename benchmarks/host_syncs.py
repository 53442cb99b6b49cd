"""Where the trainer makes the host wait for the GPU, and how long the host spends per step.

    python -m benchmarks.host_syncs --after 6 -- --preset sd2-base --set train.micro_batch=48 train.max_steps=30
    python -m benchmarks.host_syncs -- --set train.max_steps=12        # tiny preset; on CPU: step times only

Runs the trainer in this process with the arguments after `--`. From the step `--after` on (past
the compile and the warm-up), CUDA's sync debug mode reports every synchronizing call
(`.item()`, `.tolist()`, `torch.cuda.synchronize()`, a copy to pageable memory, ...): this prints
each call site with its count and the innermost frames of its stack, and the host's milliseconds
between consecutive step starts. A step that should run ahead of the GPU but shows up in the
list is a stall; a logging interval shows up as one long and one short step.

What sync debug mode does not see (a pageable host-to-device copy, an allocation that has to
free cached memory) is not listed; a profile (`train.profile_steps`) shows those as GPU idle.
Exit code: the trainer's.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import runpy
import sys
import time
import traceback
import warnings
from typing import Any, TextIO

FRAMES = 10


class SyncLog:
    """Counts each synchronizing call site (its innermost frames) that CUDA's sync debug mode warns about."""

    def __init__(self, passthrough: Any) -> None:
        self.passthrough = passthrough
        self.sites: collections.Counter[tuple[tuple[str, int, str], ...]] = collections.Counter()
        self.messages: dict[tuple[tuple[str, int, str], ...], str] = {}

    def showwarning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if "synchronizing CUDA operation" not in str(message):
            self.passthrough(message, category, filename, lineno, file, line)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        key = tuple((_short(f.filename), f.lineno or 0, f.name) for f in frames[-FRAMES:])
        self.sites[key] += 1
        self.messages.setdefault(key, str(message).split("(Triggered")[0].strip())

    def report(self) -> list[str]:
        if not self.sites:
            return ["no synchronizing call was reported"]
        lines = []
        for key, count in self.sites.most_common():
            lines.append(f"{count} x {self.messages[key]}")
            lines.extend(f"    {path}:{line} in {name}" for path, line, name in key)
        return lines


def _short(path: str) -> str:
    for marker in ("site-packages/", "/sddoctor/", "/trainer/", "/benchmarks/"):
        if marker in path:
            head = "" if marker == "site-packages/" else marker.strip("/") + "/"
            return head + path.rsplit(marker, 1)[1]
    return path


class StepClock:
    """Wraps the trainer's batch supply: notes when each step starts, and turns sync debug on at `after`."""

    def __init__(self, after: int, cuda: bool) -> None:
        self.after = after
        self.cuda = cuda
        self.starts: list[float] = []

    def install(self) -> None:
        import trainer.feed

        original = trainer.feed.Batches.next
        clock = self

        def next_batch(batches: Any) -> Any:
            clock.starts.append(time.perf_counter())
            if clock.cuda and len(clock.starts) == clock.after:
                import torch

                torch.cuda.set_sync_debug_mode("warn")
            return original(batches)

        trainer.feed.Batches.next = next_batch  # type: ignore[method-assign,assignment]

    def step_ms(self) -> list[float]:
        """Host milliseconds between consecutive step starts, from step `after` on."""
        starts = self.starts[max(self.after - 1, 0) :]
        return [round((b - a) * 1000, 1) for a, b in itertools.pairwise(starts)]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        own, trainer_args = argv[:split], argv[split + 1 :]
    else:
        own, trainer_args = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_syncs",
        description="The trainer's synchronizing calls and host time per step (arguments after -- go to the trainer).",
    )
    parser.add_argument("--after", type=int, default=6, help="step from which syncs are counted (default 6)")
    args = parser.parse_args(own)
    if args.after < 1:
        parser.error("--after must be at least 1")
    return args, trainer_args


def main(argv: list[str] | None = None) -> int:
    args, trainer_args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    cuda = torch.cuda.is_available()
    syncs = SyncLog(warnings.showwarning)
    clock = StepClock(args.after, cuda)
    clock.install()
    warnings.showwarning = syncs.showwarning
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation")
    code: Any = 0
    saved_argv = sys.argv
    sys.argv = ["trainer", *trainer_args]
    try:
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.argv = saved_argv
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    print(f"host ms between step starts, from step {args.after}: {clock.step_ms()}")
    if cuda:
        print(f"synchronizing calls from step {args.after} on:")
        print("\n".join(syncs.report()))
    else:
        print("no CUDA device: synchronizing calls are not reported")
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
