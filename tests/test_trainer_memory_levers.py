"""Memory and speed switches that need a GPU to pay off, checked where a CPU can: 8-bit AdamW
refuses a CPU run at once with the fix, the weight dtype it implies, and the attention switch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import run_to_end, subprocess_env
from trainer.config import ConfigError, build_config
from trainer.memory import unet_weights_bf16
from trainer.models import OnlyAttentionKernel, attention_kernel_scope, separate_compile_cache
from trainer.optim import OptimizerUnavailable, check_optimizer


def test_adamw8bit_on_cpu_is_exit_2_before_anything_is_built(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        "optim.name=adamw8bit",
    ]
    code, output = run_to_end(cmd, timeout=120, env=subprocess_env(SDDOCTOR_PREFLIGHT="0"))
    assert code == 2 and "Traceback" not in output, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == 1 and "optim.name=adamw8bit needs a CUDA GPU" in errors[0], output[-2000:]
    assert "use optim.name=adamw" in errors[0]
    assert "data digits" not in output  # stopped before the data and the models


def test_adamw8bit_without_bitsandbytes_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    cfg = build_config("sd2-base", overrides=["optim.name=adamw8bit"])
    with pytest.raises(OptimizerUnavailable, match=r"pip install 'sddoctor\[bnb\]'"):
        check_optimizer(cfg.optim, torch.device("cuda", 0))
    check_optimizer(build_config("sd2-base").optim, torch.device("cpu"))  # adamw: nothing to check


def test_adamw8bit_keeps_fp32_weights_and_refuses_bf16_ones():
    cuda = torch.device("cuda", 0)
    assert unet_weights_bf16("auto", "adamw", torch.bfloat16, cuda)
    assert not unet_weights_bf16("auto", "adamw8bit", torch.bfloat16, cuda)
    assert not unet_weights_bf16("auto", "adamw", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ConfigError, match="'optim.name' is 'adamw8bit'; allowed: adamw .*master copy"):
        build_config("sd2-base", overrides=["optim.name=adamw8bit", "model.unet_dtype=bf16"])
    # the memory saver leaves the optimizer's precision to 8-bit AdamW and keeps the rest
    cfg = build_config("sd2-base", overrides=["optim.name=adamw8bit", "train.memory_saver=true"])
    assert cfg.model.unet_dtype == "auto" and cfg.optim.state_dtype == "fp32"
    assert cfg.model.gradient_checkpointing and cfg.model.offload_frozen and cfg.train.ema_dtype == "bf16"


def test_attention_backend_leaves_one_kernel_to_the_unet_alone(monkeypatch, tmp_path):
    """The switch holds inside the wrapped model only (the VAE keeps every kernel), and each backend
    compiles into its own cache (a graph keeps the kernel it was traced with)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    seen = []

    class Attention(torch.nn.Module):
        def forward(self, q):
            seen.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    flash_before = torch.backends.cuda.flash_sdp_enabled()
    OnlyAttentionKernel(Attention(), "math")(torch.randn(1, 2, 4, 8))  # the math kernel runs
    assert seen == [(False, True)]
    assert torch.backends.cuda.flash_sdp_enabled() == flash_before  # outside: as it was
    separate_compile_cache("math")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "sdpa-math")
    with attention_kernel_scope("auto"):
        assert torch.backends.cuda.flash_sdp_enabled() == flash_before


@pytest.mark.parametrize("variant", ["default", "saver", "gc", "lora", "lora-gc", "lora-te"])
def test_memory_probe_builds_and_steps_each_setup(variant):
    """The probe's step (what scripts/gpu/memory24.sh measures on a GPU) runs each setup for real;
    with the text encoder's adapters, its optimizer has the trainer's two parameter groups."""
    from trainer.bench import VARIANTS
    from trainer.memory_probe import build_step

    settings = {**VARIANTS[variant], "model.compile": "false", "model.channels_last": False}
    cfg = build_config("tiny", None, [f"{k}={str(v).lower()}" for k, v in settings.items()])
    step, _ = build_step(cfg, torch.device("cpu"))
    trainable = [p for group in step.optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in trainable]
    step(2)
    step(2)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable, strict=True))
    assert all(p.grad is None for p in trainable)  # zero_grad(set_to_none) ran
    assert len(step.optimizer.param_groups) == (2 if variant == "lora-te" else 1)


def test_memory_probe_needs_cuda(capsys):
    from trainer.memory_probe import main

    assert main(["--variants", "saver"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--variants", "nonsense"])
