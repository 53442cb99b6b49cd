"""LoRA on the UNet (trainer/lora.py): adapters only train, checkpoints hold only them, the export
loads in diffusers with `load_lora_weights` and gives the trainer's outputs, and resuming repeats
the losses exactly. The runs are real: 2 gloo ranks under torchrun, with an out-of-memory
injected on rank 1 so the OOM guard's fallback runs with only the adapters requiring grad.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_to_end, subprocess_env
from sddoctor.telemetry.reader import read_events
from trainer.checkpoint import Resume, list_checkpoints, load_checkpoint
from trainer.lora import (
    LoraConfig,
    LoraError,
    adapter_state,
    add_lora,
    add_text_encoder_lora,
    diffusers_adapter,
    load_text_encoder_state,
    load_unet_state,
    plain_text_encoder,
    plain_unet,
    text_encoder_state,
    unet_state,
)
from trainer.models import build_models, load_models

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in"])


def unet_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 500]), torch.randn(2, 16, 32, generator=g)


def output(unet: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return unet.eval()(*unet_inputs(seed)).sample


def with_trained_adapters(part: str, add: Any, cfg: LoraConfig, seed: int) -> tuple[Any, str]:
    """A tiny model's `part` with adapters whose B matrices are not zero (as after some training)."""
    torch.manual_seed(seed)
    module = getattr(build_models("tiny"), part)
    base = add(module, cfg)
    assert base is not None
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return module, base


def trained_lora_unet(seed: int = 3) -> tuple[torch.nn.Module, str]:
    return with_trained_adapters("unet", add_lora, LORA, seed)


def test_only_adapters_train_and_the_start_is_the_base_model():
    torch.manual_seed(0)
    unet = build_models("tiny").unet
    before = output(unet)
    assert add_lora(unet, LoraConfig()) is None  # rank 0: full fine-tuning, nothing changes
    assert all(p.requires_grad for p in unet.parameters())
    add_lora(unet, LORA)
    trainable = [n for n, p in unet.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert any("proj_in.lora_A" in n for n in trainable)
    assert torch.equal(output(unet), before)  # B starts at zero


def test_unknown_target_is_a_clear_error():
    unet = build_models("tiny").unet
    with pytest.raises(LoraError, match=r"\['attn_nowhere'\] match no layer of this UNet; .*to_q"):
        add_lora(unet, LoraConfig(rank=2, target_modules=["to_q", "attn_nowhere"]))


def test_merged_and_plain_unets_and_the_diffusers_layout(tmp_path):
    from diffusers import StableDiffusionPipeline

    from trainer.export import export_pipeline

    unet, _ = trained_lora_unet()
    adapted = output(unet)
    merged = plain_unet(unet, merge=True)
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(output(merged), adapted, rtol=1e-5, atol=1e-6)
    base = plain_unet(unet, merge=False)
    assert not torch.allclose(output(base), adapted)

    # the adapter file alone, read by diffusers onto the base pipeline, gives the adapted outputs
    models = build_models("tiny")
    export_pipeline(models, base, tmp_path / "base")
    StableDiffusionPipeline.save_lora_weights(tmp_path / "lora", unet_lora_layers=diffusers_adapter(unet))
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "base")
    torch.testing.assert_close(output(pipe.unet), output(base))
    pipe.load_lora_weights(tmp_path / "lora")
    torch.testing.assert_close(output(pipe.unet), adapted, rtol=1e-5, atol=1e-6)


def test_checkpoint_state_refuses_what_does_not_fit():
    unet, base = trained_lora_unet()
    state = unet_state(unet, base)
    assert (
        set(state) == {"unet_lora", "lora_base"} and state["unet_lora"].keys() == adapter_state(unet).keys()
    )
    other, other_base = trained_lora_unet()  # the same base (same init seed)
    with torch.no_grad():
        for p in adapter_state(other).values():
            p.zero_()
    load_unet_state(other, state, other_base)
    for name, tensor in adapter_state(other).items():
        assert torch.equal(tensor, state["unet_lora"][name])
    with pytest.raises(ValueError, match="another base UNet"):
        load_unet_state(other, {**state, "lora_base": "0" * 64}, other_base)
    with pytest.raises(ValueError, match="holds a whole UNet"):
        load_unet_state(other, {"unet": {}}, other_base)
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        load_unet_state(other, state, None)


# -- real runs ------------------------------------------------------------------------------

STEPS = 8
RUN = [
    "data.max_samples=64",
    f"train.max_steps={STEPS}",
    "train.micro_batch=8",
    "train.log_every=2",
    "train.ema_decay=0.9",
    "checkpoint.every=4",
    "checkpoint.keep=0",
    "sample.at_end=false",
    "lora.rank=4",
    "lora.alpha=8",
    "lora.target_modules=to_q;to_k;to_v;to_out.0;proj_in",
    "lora.export_merged=true",
    "optim.lr=1e-2",
]


def train(base: Path, out: Path, cache: Path, *extra: str, fault: str = "") -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "trainer", "--model", str(base), "--output-dir", str(out), "--set", *RUN]
    cmd += [f"data.cache_dir={cache}", *extra]
    code, text = run_to_end(
        cmd, timeout=300, env=subprocess_env(SDDOCTOR_FAULT=fault, SDDOCTOR_PREFLIGHT="0")
    )
    assert code == 0, text[-4000:]
    return text


def losses(out: Path, rank: int) -> dict[int, float]:
    return {
        e["step"]: e["loss"] for e in read_events(out / "ranks" / f"rank-{rank:05d}.jsonl", kinds={"step"})
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path, Path, str]:
    from trainer.export import export_pipeline

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(3)
    models = build_models("tiny")
    base = export_pipeline(models, models.unet, root / "base")
    out, cache = root / "run", root / "cache"
    text = train(base, out, cache, fault="oom:rank=1,step=2,phase=backward")
    return base, out, cache, text


@pytest.mark.slow
def test_lora_run_under_ddp_falls_back_and_saves_only_the_adapter(lora_run):
    base, out, _, text = lora_run
    assert "OOM guard: out of memory in backward on rank(s) [1] at step 2" in text
    for rank in (0, 1):
        steps = {
            e["step"]: e["micro_batch"]
            for e in read_events(out / "ranks" / f"rank-{rank:05d}.jsonl", kinds={"step"})
        }
        assert steps[1] == 8 and steps[STEPS] == 4
    digests = [read_events(out / "ranks" / f"rank-{r:05d}.jsonl", kinds={"replicas"})[-1] for r in (0, 1)]
    assert digests[0]["params_sha256"] == digests[1]["params_sha256"]

    path = out / "checkpoints" / f"step-{STEPS:08d}"
    shared, _, _ = load_checkpoint(Resume(path, STEPS, 2, True), 0)
    assert "unet" not in shared and set(shared["unet_lora"]) and shared["lora_base"]
    assert all(".lora_A." in k or ".lora_B." in k for k in shared["unet_lora"])
    assert all(v.abs().sum() > 0 for k, v in shared["unet_lora"].items() if ".lora_B." in k)  # trained from 0
    # adapters and their Adam moments only: the checkpoint is a small fraction of the UNet
    assert (path / "state.safetensors").stat().st_size < (
        base / "unet" / "diffusion_pytorch_model.safetensors"
    ).stat().st_size / 3
    assert len(shared["optimizer"]["state"]) == len(shared["unet_lora"])


@pytest.mark.slow
def test_lora_export_reloads_in_diffusers_with_the_trainers_outputs(lora_run):
    from diffusers import StableDiffusionPipeline

    base, out, _, _ = lora_run
    info = json.loads((out / "export" / "lora.json").read_text())
    assert info["rank"] == 4 and info["alpha"] == 8 and info["base"] == str(base)
    assert not (out / "export" / "base").exists()  # the base is the --model folder

    # the trainer's adapted UNet: the base with the final checkpoint's EMA adapters
    shared, _, _ = load_checkpoint(Resume(out / "checkpoints" / f"step-{STEPS:08d}", STEPS, 2, True), 0)
    unet = load_models(str(base)).unet
    fingerprint = add_lora(
        unet, LoraConfig(rank=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in"])
    )
    assert fingerprint == shared["lora_base"]
    load_unet_state(unet, shared, fingerprint)
    with torch.no_grad():
        for p, value in zip(adapter_state(unet).values(), shared["ema"]["shadow"], strict=True):
            p.copy_(value)
    expected = output(unet)

    pipe = StableDiffusionPipeline.from_pretrained(base)
    before = output(pipe.unet)
    pipe.load_lora_weights(out / "export")
    torch.testing.assert_close(output(pipe.unet), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, expected)
    merged = StableDiffusionPipeline.from_pretrained(out / "export" / "merged")
    torch.testing.assert_close(output(merged.unet), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_resume_repeats_the_losses(lora_run, tmp_path):
    base, out, cache, _ = lora_run
    resumed = tmp_path / "resumed"
    text = train(base, resumed, cache, "--resume", str(out / "checkpoints" / "step-00000004"))
    assert "resumed from" in text and "at step 4" in text
    for rank in (0, 1):
        assert losses(resumed, rank) == {s: v for s, v in losses(out, rank).items() if s > 4}
    assert [s for s, _ in list_checkpoints(resumed / "checkpoints")] == [STEPS]


# -- the text encoder's adapters ------------------------------------------------------------

TEXT_LORA = LoraConfig(rank=4, alpha=8.0, text_encoder=True)


def text_output(text_encoder: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[3, 17, 25, 9, 2, 0, 0, 0]])
    with torch.no_grad():
        return text_encoder.eval()(ids)[0]


def trained_text_encoder(seed: int = 3) -> tuple[torch.nn.Module, str]:
    return with_trained_adapters("text_encoder", add_text_encoder_lora, TEXT_LORA, seed)


def test_text_encoder_adapters_only_train_start_at_the_base_and_merge():
    torch.manual_seed(0)
    text_encoder = build_models("tiny").text_encoder
    before = text_output(text_encoder)
    assert add_text_encoder_lora(text_encoder, LoraConfig(rank=4)) is None  # lora.text_encoder off
    assert not any(p.requires_grad for p in text_encoder.parameters())  # frozen all the same
    assert add_text_encoder_lora(text_encoder, TEXT_LORA) is not None
    trainable = [n for n, p in text_encoder.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert torch.equal(text_output(text_encoder), before)

    adapted_encoder, base = trained_text_encoder()
    adapted = text_output(adapted_encoder)
    merged = plain_text_encoder(adapted_encoder, merge=True)
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(text_output(merged), adapted, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(text_output(plain_text_encoder(adapted_encoder, merge=False)), adapted)
    with pytest.raises(LoraError, match=r"\['nowhere'\] match no layer of this text encoder; .*q_proj"):
        add_text_encoder_lora(
            build_models("tiny").text_encoder,
            LoraConfig(rank=2, text_encoder=True, text_encoder_targets=["nowhere"]),
        )


def test_text_encoder_checkpoint_state_refuses_what_does_not_fit():
    text_encoder, base = trained_text_encoder()
    state = text_encoder_state(text_encoder, base)
    other, other_base = trained_text_encoder(seed=3)
    with torch.no_grad():
        for p in adapter_state(other).values():
            p.zero_()
    load_text_encoder_state(other, state, other_base)
    torch.testing.assert_close(text_output(other), text_output(text_encoder))
    assert text_encoder_state(text_encoder, None) == {}
    load_text_encoder_state(other, {}, None)  # neither has adapters
    with pytest.raises(ValueError, match="another base text encoder"):
        load_text_encoder_state(other, {**state, "text_encoder_lora_base": "0" * 64}, other_base)
    with pytest.raises(ValueError, match="holds no text encoder adapters"):
        load_text_encoder_state(other, {}, other_base)
    with pytest.raises(ValueError, match="does not train them"):
        load_text_encoder_state(other, state, None)


def test_text_encoder_lora_needs_unet_lora_and_no_ema():
    from trainer.config import Config, ConfigError, validate

    cfg = Config()
    cfg.lora.text_encoder = True
    with pytest.raises(ConfigError, match="lora.text_encoder.*lora.rank > 0"):
        validate(cfg)
    cfg.lora.rank = 4
    cfg.train.ema_decay = 0.999
    with pytest.raises(ConfigError, match="train.ema_decay.*UNet's weights only"):
        validate(cfg)
    cfg.train.ema_decay = 0.0
    validate(cfg)


TEXT_RUN = [
    "train.max_steps=4",
    "checkpoint.every=2",
    "train.ema_decay=0",
    "lora.text_encoder=true",
    "lora.text_encoder_lr=5e-3",
    "train.caption_dropout=0.25",
]


@pytest.fixture(scope="module")
def text_lora_run(lora_run, tmp_path_factory) -> tuple[Path, Path, Path]:
    base, _, cache, _ = lora_run
    out = tmp_path_factory.mktemp("text-lora") / "run"
    train(base, out, cache, *TEXT_RUN)
    return base, out, cache


@pytest.mark.slow
def test_text_encoder_lora_run_exports_what_diffusers_reloads_and_resumes_exactly(text_lora_run, tmp_path):
    """Both models' adapters train under DDP (the cached latents are used, the cached text is not),
    the export reloads in diffusers with the trainer's text encoder and UNet outputs, and a resume
    repeats the losses."""
    from diffusers import StableDiffusionPipeline

    base, out, cache = text_lora_run
    shared, _, _ = load_checkpoint(Resume(out / "checkpoints" / "step-00000004", 4, 2, True), 0)
    assert shared["text_encoder_lora_base"] and set(shared["text_encoder_lora"])
    assert all(v.abs().sum() > 0 for k, v in shared["text_encoder_lora"].items() if ".lora_B." in k)
    unet_lr, text_lr = (g["lr"] for g in shared["optimizer"]["param_groups"])
    assert text_lr == pytest.approx(unet_lr * 5e-3 / 1e-2)  # lora.text_encoder_lr, under the same schedule

    models = load_models(str(base))
    unet_base = add_lora(models.unet, LORA)
    text_base = add_text_encoder_lora(models.text_encoder, TEXT_LORA)
    load_unet_state(models.unet, shared, unet_base)
    load_text_encoder_state(models.text_encoder, shared, text_base)
    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.load_lora_weights(out / "export")
    torch.testing.assert_close(text_output(pipe.text_encoder), text_output(models.text_encoder))
    torch.testing.assert_close(output(pipe.unet), output(models.unet), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(
        text_output(pipe.text_encoder), text_output(load_models(str(base)).text_encoder)
    )
    merged = StableDiffusionPipeline.from_pretrained(out / "export" / "merged")
    torch.testing.assert_close(
        text_output(merged.text_encoder), text_output(models.text_encoder), rtol=1e-5, atol=1e-6
    )

    resumed = tmp_path / "resumed"
    text = train(base, resumed, cache, *TEXT_RUN, "--resume", str(out / "checkpoints" / "step-00000002"))
    assert "at step 2" in text
    for rank in (0, 1):
        assert losses(resumed, rank) == {s: v for s, v in losses(out, rank).items() if s > 2}
