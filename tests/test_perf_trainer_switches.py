"""The trainer's speed and memory switches (model.unet_dtype, train.memory_saver, ...), on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env
from trainer.config import MEMORY_SAVER, ConfigError, build_config


def test_memory_saver_sets_its_keys_unless_given_explicitly():
    cfg = build_config("sd2-base", None, ["train.memory_saver=true", "optim.master_weights=true"])
    assert cfg.model.gradient_checkpointing and cfg.model.offload_frozen and cfg.data.cache
    assert (
        cfg.model.unet_dtype == "bf16" and cfg.optim.state_dtype == "bf16" and cfg.train.ema_dtype == "bf16"
    )
    assert cfg.optim.master_weights is True  # explicit --set wins over the preset of settings
    plain = build_config("sd2-base", None, [])
    assert not plain.train.memory_saver and not plain.model.gradient_checkpointing
    assert set(MEMORY_SAVER) <= {
        f"{a}.{b}" for a in ("model", "optim", "data", "train") for b in dir(getattr(plain, a))
    }


def test_every_bench_variant_is_a_valid_trainer_config():
    from trainer.bench import VARIANTS, _fmt

    for name, settings in VARIANTS.items():
        flags = [f"{key}={_fmt(value)}" for key, value in settings.items()]
        cfg = build_config("sd2-base", None, flags)
        for key, value in settings.items():
            section, field = key.split(".")
            assert getattr(getattr(cfg, section), field) == value, (name, key)
    off = build_config("sd2-base", None, ["train.trace_collectives=false", "train.oom_guard=false"])
    assert not off.train.trace_collectives and not off.train.oom_guard


def test_bad_precision_values_are_config_errors():
    with pytest.raises(ConfigError, match="model.unet_dtype"):
        build_config("tiny", None, ["model.unet_dtype=fp8"])
    with pytest.raises(ConfigError, match="optim.state_dtype"):
        build_config("tiny", None, ["optim.state_dtype=int4"])


def test_memory_saver_run_trains_with_bf16_state(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--output-dir",
        str(out),
        "--set",
        "train.memory_saver=true",
        "train.max_steps=4",
        "train.micro_batch=8",
        "train.log_every=2",
        "model.vae_warmup_steps=0",
        "data.max_samples=32",
        "sample.at_end=false",
        "output.export=false",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    events = [json.loads(line) for line in (out / "ranks" / "rank-00000.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(e["data_wait"] >= 0 for e in steps)
    assert all(e["loss"] == e["loss"] for e in steps)  # no NaN from bf16 state


def test_compile_options_become_torch_compile_options_merged_with_the_mode():
    from trainer.models import compile_arguments

    assert compile_arguments("inductor", "", []) == {"mode": None}
    assert compile_arguments("inductor", "reduce-overhead", []) == {"mode": "reduce-overhead"}
    how = compile_arguments(
        "inductor", "reduce-overhead", ["triton.prefer_nd_tiling=true", "split_reductions=False"]
    )
    assert how == {
        "options": {"triton.cudagraphs": True, "triton.prefer_nd_tiling": True, "split_reductions": False}
    }
    # torch.compile of this torch takes them: a real Inductor compile of a small module
    import torch

    linear = torch.nn.Linear(4, 4)
    compiled = torch.compile(
        linear, backend="inductor", **compile_arguments("inductor", "", ["split_reductions=false"])
    )
    x = torch.randn(3, 4)
    assert torch.allclose(compiled(x), linear(x))


@pytest.mark.parametrize(
    "entries, backend, words",
    [
        (["no_such_setting=1"], "inductor", "'no_such_setting' is not an Inductor setting"),
        (["max_autotune=3"], "inductor", "max_autotune takes true or false"),
        (["triton.prefer_nd_tiling=true"], "aot_eager", "model.compile_backend is 'aot_eager'"),
    ],
)
def test_bad_compile_options_are_config_errors(entries, backend, words):
    from trainer.models import compile_arguments

    with pytest.raises(ConfigError, match=words):
        compile_arguments(backend, "", entries)


def test_a_bad_compile_option_exits_2_with_its_name_and_no_traceback(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--output-dir",
            str(tmp_path / "out"),
            "--quiet",
            "--set",
            "model.compile=true",
            "model.compile_options=no_such_setting=1",
            "train.max_steps=1",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "'no_such_setting' is not an Inductor setting" in run.stderr
    assert "Traceback" not in run.stderr
