"""The bundled, instrumented DDP Stable Diffusion trainer (`python -m trainer`).

Its stack (diffusers, transformers, ...) is the `trainer` extra: `pip install "sddoctor[trainer]"`.
`sddoctor` itself (run, report, tui, check-nccl, trace) needs none of it.
"""

from __future__ import annotations

import importlib.util
import sys

#: module -> the package that installs it: what the trainer needs beyond sddoctor's own dependencies
STACK = {
    "diffusers": "diffusers",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "peft": "peft",
    "tensorboard": "tensorboard",
}
#: exit code when part of the stack is missing (the same code as sddoctor's "a dependency is missing")
EXIT_MISSING_STACK = 5


def missing_stack() -> list[str]:
    """The packages of the trainer's stack that are not installed (found without importing them)."""
    return [package for module, package in STACK.items() if importlib.util.find_spec(module) is None]


def exit_if_stack_missing(program: str = "trainer") -> None:
    """One line naming what to install, and exit code 5, when part of the trainer's stack is missing."""
    missing = missing_stack()
    if missing:
        print(
            f"{program}: error: the bundled trainer needs {', '.join(missing)}, not installed here: "
            'pip install "sddoctor[trainer]"',
            file=sys.stderr,
        )
        raise SystemExit(EXIT_MISSING_STACK)
