"""Install what you use: `pip install sddoctor` brings what sddoctor/ imports and nothing of the
trainer's stack; `pip install "sddoctor[trainer]"` adds what trainer/ imports; the trainer
without its stack says what to install (one line, exit code 5)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
#: core dependencies sddoctor/ uses without importing them: py-spy is a program (it takes the ranks'
#: stacks); torch's object collectives (check-nccl's test processes) need numpy, undeclared by torch
NOT_IMPORTED = {"py-spy", "numpy"}
#: [trainer] packages trainer/ uses without importing them by name: torch.utils.tensorboard writes
#: the training curves with the tensorboard package
TRAINER_NOT_IMPORTED = {"tensorboard"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    trainer = {_name(r) for r in project["optional-dependencies"]["trainer"]}
    return core, trainer


def _optional_features() -> set[str]:
    """Packages of the extras for one optional feature each (8-bit AdamW, wandb), not dev's."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {_name(r) for name, reqs in extras.items() if name not in ("trainer", "dev") for r in reqs}


def _imported(package: str) -> set[str]:
    """Top-level modules outside the standard library and the project that `package` imports."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"__future__", "sddoctor", "trainer"}


def _distributions(module: str) -> set[str]:
    known = importlib.metadata.packages_distributions().get(module) or [module]
    return {re.sub(r"[-_.]+", "-", d).lower() for d in known}


def test_sddoctor_declares_what_it_imports_and_nothing_more():
    core, trainer = _declared()
    imported = _imported("sddoctor")
    undeclared = {m for m in imported if not _distributions(m) & core}
    assert not undeclared, f"sddoctor/ imports modules no core dependency installs: {undeclared}"
    used = set().union(*(_distributions(m) for m in imported)) | NOT_IMPORTED
    assert core <= used, f"core dependencies sddoctor/ does not import: {core - used}"
    assert not core & trainer, "a package is in both the core dependencies and the trainer extra"


def test_the_trainer_extra_brings_what_the_trainer_imports():
    core, trainer = _declared()
    imported = _imported("trainer")
    undeclared = {m for m in imported if not _distributions(m) & (core | trainer | _optional_features())}
    assert not undeclared, (
        f"trainer/ imports modules no core, [trainer] or feature extra installs: {undeclared}"
    )
    used = set().union(*(_distributions(m) for m in imported)) | TRAINER_NOT_IMPORTED
    assert trainer <= used, f"[trainer] packages trainer/ does not import: {trainer - used}"


@pytest.mark.parametrize("command", [["trainer", "--help"], ["trainer.bench", "--help"]])
def test_the_trainer_without_its_stack_says_what_to_install(command):
    # sys.modules[name] = None is how the import system marks a module as not importable
    code = (
        "import runpy, sys\n"
        "for name in ('diffusers', 'sklearn'):\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = {command!r}\n"
        f"runpy.run_module({command[0]!r}, run_name='__main__', alter_sys=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=60
    )
    assert out.returncode == 5, out.stderr
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "diffusers, scikit-learn" in out.stderr and 'pip install "sddoctor[trainer]"' in out.stderr
