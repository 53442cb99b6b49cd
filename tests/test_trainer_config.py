"""The trainer's configuration layers, and bad input turning into exit code 2 without a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env
from trainer.config import ConfigError, build_config, to_toml


def test_layers_apply_in_order(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[train]\nmax_steps = 7\nmicro_batch = 3\n[optim]\nbetas = [0.8, 0.99]\n[data]\nsource = "digits"\n'
    )
    cfg = build_config(
        "tiny", str(toml), ["train.micro_batch=5", "sample.prompts=a;b c", "data.max_samples=64"]
    )
    assert cfg.model.preset == "tiny"
    assert cfg.data.resolution == 32  # from the preset
    assert cfg.train.max_steps == 7  # from the file, over the preset
    assert cfg.train.micro_batch == 5  # from --set, over the file
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.sample.prompts == ["a", "b c"]
    assert cfg.data.max_samples == 64
    assert build_config("sd2-base").data.resolution == 512


def test_printed_config_loads_back(tmp_path):
    cfg = build_config("tiny", overrides=["train.max_steps=11", "ddp.static_graph=true"])
    path = tmp_path / "printed.toml"
    path.write_text(to_toml(cfg))
    again = build_config(config_file=str(path))
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.max_step=3"], "unknown config key 'train.max_step'"),
        (["trian.max_steps=3"], "valid keys at the top level: model, data, train"),
        (["train.max_steps=three"], "expects int"),
        (["ddp.static_graph=maybe"], "expects bool"),
        (["train.mixed_precision=fp8"], "allowed: one of 'auto'"),
        (["train.max_steps"], "expects key.sub=value"),
        (["train=3"], "is a section"),
        (["model.preset=sd3"], "unknown preset 'sd3'"),
    ],
)
def test_bad_overrides_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        build_config(overrides=overrides)
    assert needle in str(info.value)


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError) as info:
        build_config(overrides=["train.lr=1"])
    assert "train.max_steps" in str(info.value) and "train.micro_batch" in str(info.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        build_config(config_file=str(tmp_path / "nope.toml"))


def test_mistyped_toml_value(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nmax_steps = "many"\n')
    with pytest.raises(ConfigError) as info:
        build_config(config_file=str(toml))
    assert "train.max_steps" in str(info.value) and str(toml) in str(info.value)


def _run_trainer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_command_line_bad_input_exits_2(tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train\nmax_steps = 1\n")
    result = _run_trainer("--config", str(bad_toml))
    assert result.returncode == 2, result.stderr
    assert "not valid TOML" in result.stderr and "Traceback" not in result.stderr

    result = _run_trainer("--set", "train.bogus=1")
    assert result.returncode == 2
    assert "unknown config key 'train.bogus'" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_folder_exits_2(tmp_path):
    result = _run_trainer("--model", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_help_documents_exit_codes():
    result = _run_trainer("--help")
    assert result.returncode == 0
    assert "exit codes:" in result.stdout and "2    bad input" in result.stdout


def test_compile_switch_takes_toml_booleans_and_auto(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\ncompile = true\n")
    assert build_config(config_file=str(toml)).model.compile == "true"
    assert build_config(preset="sd2-base").model.compile == "auto"
    assert build_config(preset="tiny").model.compile == "false"
    with pytest.raises(ConfigError, match="model.compile"):
        build_config(overrides=["model.compile=sometimes"])
