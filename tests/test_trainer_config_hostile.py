"""Every key of the config tree against hostile values: a clear one-line error or a clean run.

The walk itself is pure config parsing (every value is validated before a process group, data
or model exists), so it checks every key with every hostile value in a second. The values that
pass validation then go through real tiny runs (slow), packed so that each run sets each key
once: they must end with exit 0, or 2 / 3 with one `trainer: error:` line, and no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from trainer.config import RULES, ConfigError, build_config, get_key, leaf_keys

HOSTILE = {
    "zero": "0",
    "negative": "-1",
    "nan": "nan",
    "inf": "inf",
    "-inf": "-inf",
    "huge int": "1" + "0" * 30,
    "huge float": "1e30",
    "fraction": "0.5",
    "wrong type (list)": "[1, 2]",
    "wrong type (word)": "abc",
    "empty": "",
}

#: Keys holding a path or a name the trainer uses as given: any text is a valid value, and what
#: it names is checked where it is used (the slow test runs one representative of each).
PATHS_CHECKED_LATER = ("model.path", "data.source", "checkpoint.resume")
FREE_TEXT = (
    "data.caption_column",
    "data.image_column",
    "data.cache_dir",
    "output.dir",
    "sample.prompts",
    "lora.target_modules",
    "lora.text_encoder_targets",
)


def walk() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """(rejected (key, value, message), accepted (key, value)) over every key x hostile value."""
    rejected, accepted = [], []
    for key in leaf_keys():
        for value in HOSTILE.values():
            try:
                build_config(overrides=[f"{key}={value}"])
            except ConfigError as exc:
                rejected.append((key, value, str(exc)))
            else:
                accepted.append((key, value))
    return rejected, accepted


def test_every_key_has_a_rule():
    assert set(leaf_keys()) == set(RULES)


def test_every_key_rejects_hostile_values_in_one_line_naming_key_and_value():
    rejected, accepted = walk()
    assert len(rejected) + len(accepted) == len(leaf_keys()) * len(HOSTILE)
    for key, value, message in rejected:
        assert "\n" not in message, message
        assert f"'{key}'" in message, message
        assert " is " in message or f"got {value!r}" in message or "unknown preset" in message, message
        assert "allowed:" in message or "expects" in message or "valid presets" in message, message
    accepted_keys = {key for key, _ in accepted}
    # what may pass: text that names something, switches given as 0, numbers where 0 / 1e30 make sense
    numbers_accepting_huge = {k for k, v in accepted if v in ("1e30", HOSTILE["huge int"])}
    assert numbers_accepting_huge <= {
        "model.vae_warmup_lr",
        "optim.lr",
        "optim.weight_decay",
        "train.max_grad_norm",
        "train.min_snr_gamma",
        *PATHS_CHECKED_LATER,
        *FREE_TEXT,
        "output.name",
    }, numbers_accepting_huge
    assert not {k for k, v in accepted if v in ("nan", "inf", "-inf")} - {
        *PATHS_CHECKED_LATER,
        *FREE_TEXT,
        "output.name",
    }
    # the known offenders of earlier versions
    for key, value in [
        ("data.resolution", "33"),
        ("optim.lr", "nan"),
        ("optim.lr", "inf"),
        ("optim.betas", "2"),
        ("optim.betas", "2,2"),
        ("model.vae_warmup_batch", "0"),
        ("ddp.timeout_s", "0"),
        ("sample.images_per_prompt", "0"),
        ("data.source", ""),
        ("output.name", "../../elsewhere"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_config(overrides=[f"{key}={value}"])
    assert "train.max_steps" not in accepted_keys or ("train.max_steps", "0") not in accepted


@pytest.mark.parametrize("kind", ["number for text", "text for number", "table", "list for scalar"])
def test_mistyped_toml_values_are_named(tmp_path, kind):
    """TOML carries types: a value of the wrong type for any key is a ConfigError, never a crash."""
    for key in leaf_keys():
        current = get_key(build_config(), key)
        section, name = key.split(".")
        if kind == "number for text":
            if not isinstance(current, str):
                continue
            value = "3"
        elif kind == "text for number":
            if isinstance(current, str) or current is None:
                continue
            value = '"many"'
        elif kind == "table":
            value = "{ a = 1 }"
        else:
            if isinstance(current, (list, tuple)):
                continue
            value = "[1, 2]"
        toml = tmp_path / "run.toml"
        toml.write_text(f"[{section}]\n{name} = {value}\n")
        with pytest.raises(ConfigError) as info:
            build_config(config_file=str(toml))
        assert key in str(info.value) and "\n" not in str(info.value), str(info.value)


# -- the accepted values, in real runs ------------------------------------------------------

BASE = [
    "model.vae_warmup_steps=2",
    "data.max_samples=16",
    "train.max_steps=2",
    "train.micro_batch=4",
    "train.log_every=1",
    "data.num_workers=0",
    "sample.prompts=a handwritten digit one",
    "sample.images_per_prompt=1",
    "sample.steps=2",
    "output.dir=out",
]


#: Values that make training explode by design: each gets a run of its own, where it must end
#: with exit 3 (diverged, nothing saved), so that it cannot hide what the other values do.
EXPLODING = {("optim.lr", "1e30"), ("model.vae_warmup_lr", "1e30"), ("optim.weight_decay", "1e30")}


def packed_runs(accepted: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The accepted (key, value) pairs in a few runs, each key once a run.

    A path key that names nothing gets its own test below; free text keeps one representative
    (the trainer passes it on unexamined); "1" + 30 zeros is the same number as 1e30.
    """
    runs: dict[str, list[tuple[str, str]]] = {"plain": [], "fractions": [], "huge": []}
    for key, value in accepted:
        if (key in PATHS_CHECKED_LATER and value) or value == HOSTILE["huge int"]:
            continue
        if (key, value) in EXPLODING:
            runs[f"{key}={value}"] = [(key, value)]
            continue
        group = {"0.5": "fractions", "1e30": "huge"}.get(value, "plain")
        if key in FREE_TEXT + ("output.name",) and any(k == key for run in runs.values() for k, _ in run):
            continue
        if key not in {k for k, _ in runs[group]}:
            runs[group].append((key, value))
    return runs


def run_trainer(cwd: Path, overrides: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--set", *BASE, *overrides],
        cwd=cwd,
        env=subprocess_env(SDDOCTOR_CACHE_DIR=str(cwd / "cache"), SDDOCTOR_PREFLIGHT="0"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_clean(result: subprocess.CompletedProcess[str], what: str) -> None:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, f"{what}:\n{output[-3000:]}"
    assert result.returncode in (0, 2, 3), f"{what}: exit {result.returncode}\n{output[-3000:]}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == (0 if result.returncode == 0 else 1), f"{what}:\n{output[-3000:]}"


@pytest.mark.slow
def test_accepted_hostile_values_run_cleanly(tmp_path):
    _, accepted = walk()
    runs = packed_runs(accepted)
    assert len(runs) == 3 + len(EXPLODING), runs
    for index, (name, run) in enumerate(runs.items()):
        cwd = tmp_path / f"run-{index}"
        cwd.mkdir()
        overrides = [f"{key}={value}" for key, value in run]
        result = run_trainer(cwd, overrides)
        assert_clean(result, " ".join(overrides))
        if name in {f"{k}={v}" for k, v in EXPLODING}:
            assert result.returncode == 3 and "diverged" in result.stderr, result.stderr[-2000:]
            assert not list(cwd.glob("out/checkpoints/step-*")) and not (cwd / "out" / "export").exists()
        elif name == "plain":
            assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("key", PATHS_CHECKED_LATER)
def test_a_path_that_does_not_exist_is_exit_2(tmp_path, key):
    result = run_trainer(tmp_path, [f"{key}=nan"])
    assert_clean(result, key)
    assert result.returncode == 2 and "nan" in result.stderr, result.stderr[-2000:]
