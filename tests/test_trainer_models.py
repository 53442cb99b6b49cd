"""Model presets (real SD architectures, counted on the meta device), the local tokenizer, and --model PATH."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, subprocess_env
from trainer.models import (
    ModelLoadError,
    build_models,
    build_on_meta,
    build_tokenizer,
    count_parameters,
    load_models,
)


def test_sd2_base_architecture_matches_the_published_counts():
    counts = {name: count_parameters(m) for name, m in build_on_meta("sd2-base").items()}
    assert counts == {"unet": 865_910_724, "vae": 83_653_863, "text_encoder": 340_387_840}
    assert build_on_meta("sd2-base")["text_encoder"].config.num_hidden_layers == 23


def test_sd15_architecture_matches_the_published_counts():
    counts = {name: count_parameters(m) for name, m in build_on_meta("sd15").items()}
    assert counts == {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


def test_local_tokenizer_merges_caption_words():
    tokenizer = build_tokenizer(model_max_length=16)
    ids = tokenizer(["a handwritten digit seven"], padding="max_length", max_length=16).input_ids[0]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:5] == ["<|startoftext|>", "a</w>", "handwritten</w>", "digit</w>", "seven</w>"]
    assert len(ids) == 16
    # Any text still tokenizes (byte alphabet), and differs from other text.
    other = tokenizer(["Zürich 42!"]).input_ids[0]
    assert other != ids and tokenizer.unk_token_id not in other[1:-1]  # no unknown symbol inside


def test_model_path_errors_name_the_missing_part(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_models(str(tmp_path / "missing"))
    (tmp_path / "partial" / "unet").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="lacks vae/, text_encoder/, tokenizer/, scheduler/"):
        load_models(str(tmp_path / "partial"))


def test_trainer_starts_from_a_saved_model_folder(tmp_path):
    """Save a tiny model as a diffusers folder, train from it with --model, and check it was used."""
    from trainer.export import export_pipeline

    torch.manual_seed(3)
    models = build_models("tiny")
    models.vae.register_to_config(scaling_factor=0.5)
    folder = export_pipeline(models, models.unet, tmp_path / "saved")
    loaded = load_models(str(folder))
    assert loaded.vae.config.scaling_factor == 0.5 and not loaded.from_scratch
    assert torch.equal(loaded.unet.conv_in.weight, models.unet.conv_in.weight)

    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--model",
            str(folder),
            "--output-dir",
            str(out),
            "--set",
            "train.max_steps=2",
            "train.micro_batch=4",
            "data.max_samples=32",
            "data.cache=false",
            "sample.at_end=false",
            "checkpoint.at_end=false",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"model {folder}" in result.stdout
    exported = load_models(str(out / "export"))
    # Trained for two steps from the saved weights: same architecture, moved weights, same VAE.
    assert exported.vae.config.scaling_factor == 0.5
    assert torch.equal(exported.vae.encoder.conv_in.weight, models.vae.encoder.conv_in.weight)
    assert not torch.equal(exported.unet.conv_in.weight, models.unet.conv_in.weight)


def test_sd2_768_v_preset_is_sd2_base_with_v_prediction():
    from trainer.config import build_config

    counts = {name: count_parameters(m) for name, m in build_on_meta("sd2").items()}
    assert counts == {"unet": 865_910_724, "vae": 83_653_863, "text_encoder": 340_387_840}
    cfg = build_config("sd2")
    assert cfg.data.resolution == 768 and cfg.model.preset == "sd2"
    from trainer.models import ARCHITECTURES, build_scheduler

    assert build_scheduler(ARCHITECTURES["sd2"]["scheduler"]).config.prediction_type == "v_prediction"
    assert ARCHITECTURES["sd2-base"]["scheduler"]["prediction_type"] == "epsilon"
