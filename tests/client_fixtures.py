"""Helpers of the real-client suite: the programs under tests/clients/, how each is launched, and a
reader of tracebacks that finds errors raised by sddoctor's own code inside a rank."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from supervise_fixtures import Supervised

import sddoctor
from conftest import REPO_ROOT, free_port

CLIENTS = REPO_ROOT / "tests" / "clients"
SDDOCTOR_DIR = str(Path(sddoctor.__file__).resolve().parent)


@dataclass(frozen=True)
class Client:
    """A user program and how it is launched (2 ranks, CPU, gloo)."""

    name: str
    script: Path
    kind: str  # torchrun | spawn | accelerate
    batch: int  # samples per micro-batch (the program's BATCH default)
    env: dict[str, str] = field(default_factory=dict)
    #: collective numbers (default group) that are a gradient all-reduce / a barrier, with BARRIER_EVERY=2
    grad_seq: int = 3
    barrier_seq: int = 3
    #: the marker of the line where an injected step fault fires and of the backward (user frames);
    #: Lightning runs the user's code from inside trainer.fit, so its line is that call
    forward: str = "# FORWARD"
    backward: str = "# BACKWARD"
    barrier: str = "# BARRIER"

    def command(self) -> list[str]:
        script = str(self.script)
        if self.kind == "spawn":
            return [sys.executable, script]
        if self.kind == "accelerate":
            return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--main_process_port", str(free_port()), script]  # fmt: skip
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
        ]

    def environment(self, **extra: str) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": "1", **self.env, **extra}
        if self.kind == "spawn":
            env["MASTER_PORT"] = str(free_port())
        if self.kind == "accelerate":
            env["ACCELERATE_USE_CPU"] = "true"
        return env

    def line(self, marker: str) -> str:
        for number, text in enumerate(self.script.read_text().splitlines(), start=1):
            if marker in text:
                return f"{self.script}:{number}"
        raise AssertionError(f"{marker!r} not in {self.script}")


CLIENTS_BY_NAME = {
    c.name: c
    for c in (
        Client("ddp", CLIENTS / "ddp_tutorial.py", "torchrun", 20),
        Client("spawn", CLIENTS / "spawn_tutorial.py", "spawn", 16),
        # seq 1 is the broadcast of accelerate's prepare(); then one gradient all-reduce a step
        Client("accelerate", CLIENTS / "accelerate_script.py", "accelerate", 8, grad_seq=3, barrier_seq=4),
        # Lightning: 1 broadcast_object_list, barriers #2-#7 and #9 and two scalar all-reduces while it
        # sets up, then per step a broadcast of its own and the gradient all-reduce (#12, #14, ...);
        # the user's line is trainer.fit()
        Client(
            "lightning",
            CLIENTS / "lightning_script.py",
            "torchrun",
            8,
            grad_seq=14,
            barrier_seq=2,
            forward="# FIT",
            backward="# FIT",
            barrier="# FIT",
        ),  # fmt: skip
        Client("diffusers", CLIENTS / "diffusers_style.py", "torchrun", 4, grad_seq=2, barrier_seq=3),
        # transformers' Trainer wraps the model in DDP itself; one gradient all-reduce a step from
        # #1, the callback's barrier after every second step (#3); the user's line is trainer.train()
        Client(
            "hf-trainer",
            CLIENTS / "hf_trainer_script.py",
            "torchrun",
            8,
            grad_seq=3,
            barrier_seq=3,
            forward="# TRAIN",
            backward="# TRAIN",
        ),  # fmt: skip
    )
}

_TRACEBACK = "Traceback (most recent call last):"
_NEXT = ("Traceback", "During handling", "The above exception")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')
#: a communication error that a rank raises because a peer went away: a consequence, not a cause
_PEER_GONE = re.compile(
    r"connection (closed|reset)|peer|broken pipe|SignalException|got signal", re.IGNORECASE
)


def assert_no_sddoctor_traceback(res: Supervised) -> None:
    """Neither sddoctor's output nor the ranks' (the run folder's stderr.log) holds a traceback
    of an error raised by sddoctor's own code."""
    log = res.run_dir / "stderr.log"
    bad = sddoctor_tracebacks(res.stderr + (log.read_text() if log.exists() else ""))
    assert not bad, "sddoctor raised inside a rank:\n" + "\n\n".join(bad)


def sddoctor_tracebacks(text: str) -> list[str]:
    """Tracebacks in `text` of an exception that sddoctor's own code raised (not an injected fault,
    not a communication error after a peer died, not the stop's Ctrl-C reaching a rank that a skip
    fault holds inside sddoctor's code): each as its text."""
    bad = []
    all_lines = text.splitlines()
    for first, line in enumerate(all_lines):
        if _TRACEBACK not in line:
            continue
        # torchelastic's @record prints the traceback indented in its error summary: read it as
        # printed at the margin
        lines, start = _dedented(all_lines[first : first + 500]), 0
        frames: list[str] = []
        end = start + 1
        while end < len(lines):
            match = _FRAME.match(lines[end])
            if match:
                frames.append(match.group(1))
            elif lines[end] and not lines[end].startswith(" "):
                break
            end += 1
        stop = end + 1  # the exception's message, with torch's "At:" lines of a failed callback
        while stop < min(len(lines), end + 40) and not lines[stop].startswith(_NEXT):
            if lines[stop].strip() and not lines[stop].startswith((" ", "At:")):
                break
            stop += 1
        block = "\n".join(lines[start:stop])
        message = "\n".join(lines[end:stop])
        ours = (bool(frames) and frames[-1].startswith(SDDOCTOR_DIR)) or SDDOCTOR_DIR in message
        interrupted = message.startswith("KeyboardInterrupt")
        if ours and not ("InjectedFault" in message or interrupted or _PEER_GONE.search(message)):
            bad.append(block)
    return bad


def _dedented(lines: list[str]) -> list[str]:
    """A traceback's lines (the first is its header) with the indentation of the header's frames
    removed down to the usual two spaces."""
    frame = next((line for line in lines[1:3] if _FRAME.match(line)), None)
    pad = len(frame) - len(frame.lstrip()) - 2 if frame else 0
    if pad <= 0:
        return lines
    return [lines[0], *(line[pad:] if line[:pad].isspace() else line for line in lines[1:])]
