"""Export of the trained model: a diffusers folder and a single-file checkpoint.

    export/
      model_index.json, unet/, vae/, scheduler/      diffusers' save_pretrained
      text_encoder/                                  config.json + model.safetensors with transformers
                                                     4.x key names (`text_model.` prefix), which 5.x reads too
      tokenizer/                                     tokenizer.json and the files of the slow tokenizer
                                                     (vocab.json, merges.txt, special_tokens_map.json)
      NAME.safetensors                               the whole pipeline in the original single-file layout

`StableDiffusionPipeline.from_pretrained(folder)` and `python -m trainer --model folder` load the
folder; `StableDiffusionPipeline.from_single_file(folder / "NAME.safetensors", config=str(folder),
local_files_only=True)` loads the single file with the folder's configs, nothing fetched. With
EMA on, the UNet written is the EMA one. Everything is written to a temporary folder first and
renamed into place.

A LoRA run (`lora.rank > 0`) exports its adapter instead (`export_lora`):

    export/
      pytorch_lora_weights.safetensors   diffusers' LoRA layout: pipe.load_lora_weights("export")
      lora.json                          rank, alpha, target layers, the base model it applies to
      base/                              the base pipeline as above, when it exists nowhere else
                                         (a preset built from scratch; with --model it is that folder)
      merged/                            with lora.export_merged=true: a pipeline with the adapters
                                         merged into the weights (plus merged/NAME.safetensors)

With lora.text_encoder the weights file holds the text encoder's adapters too (`text_encoder.`
keys), and base/ and merged/ hold its base or merged weights.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from trainer import lora as lora_adapters
from trainer.ldm_layout import single_file_state, text_encoder_keys
from trainer.lora import LoraConfig
from trainer.models import Models
from trainer.optim import EMA
from trainer.safe_state import write_safetensors
from trainer.sample import build_pipeline, ema_weights


def export_model(
    models: Models,
    unet: torch.nn.Module,
    out_dir: Path,
    ema: EMA | None = None,
    single_file: str = "model",
    lora: LoraConfig | None = None,
) -> Path:
    """The run's export: the whole pipeline, or with `lora` (a LoRA run's settings) the adapter."""
    if lora is not None:
        return export_lora(models, unet, out_dir, lora, ema, single_file)
    return export_pipeline(models, unet, out_dir, ema, single_file)


def export_lora(
    models: Models,
    unet: torch.nn.Module,
    out_dir: Path,
    lora: LoraConfig,
    ema: EMA | None = None,
    single_file: str = "model",
) -> Path:
    """Write a LoRA run's export folder atomically (see the module doc). Returns its path."""
    from diffusers import StableDiffusionPipeline

    tmp = _fresh_tmp(out_dir)
    text_encoder = models.text_encoder
    text_trains = bool(lora_adapters.lora_layers(text_encoder))
    with ema_weights(unet, ema):
        tmp.mkdir(parents=True)
        StableDiffusionPipeline.save_lora_weights(
            tmp,
            unet_lora_layers=lora_adapters.diffusers_adapter(unet),
            text_encoder_lora_layers=lora_adapters.diffusers_adapter(text_encoder) if text_trains else None,
            safe_serialization=True,
        )
        info = {
            "rank": lora.rank,
            "alpha": lora.alpha or lora.rank,
            "target_modules": list(lora.target_modules),
            "text_encoder_target_modules": list(lora.text_encoder_targets) if text_trains else [],
            "scale_folded_into_up_weights": (lora.alpha or lora.rank) / lora.rank,
            "base": "base/" if models.from_scratch else models.source,
        }
        (tmp / "lora.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        for folder, merge, wanted in (("base", False, models.from_scratch), ("merged", True, lora.export_merged)):
            if wanted:
                plain = replace(models, text_encoder=lora_adapters.plain_text_encoder(text_encoder, merge))
                export_pipeline(plain, lora_adapters.plain_unet(unet, merge), tmp / folder, None, single_file)
    _replace(tmp, out_dir)
    return out_dir


def _fresh_tmp(out_dir: Path) -> Path:
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _replace(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` folder to `out_dir`, replacing an earlier export in one rename."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def export_pipeline(
    models: Models, unet: torch.nn.Module, out_dir: Path, ema: EMA | None = None, single_file: str = "model"
) -> Path:
    """Write the diffusers folder (and `single_file`.safetensors in it) atomically. Returns its path."""
    tmp = _fresh_tmp(out_dir)
    with ema_weights(unet, ema):
        pipe = build_pipeline(models, unet)
        pipe.save_pretrained(tmp, safe_serialization=True)
        _write_text_encoder(tmp / "text_encoder", models.text_encoder)
        _complete_tokenizer(tmp / "tokenizer", models.tokenizer)
        # Device tensors go to the host one at a time as they are written.
        weights = single_file_state(
            unet.state_dict(), models.vae.state_dict(), models.text_encoder.state_dict()
        )
        write_safetensors(tmp / f"{single_file}.safetensors", weights, {"format": "pt"})
    _replace(tmp, out_dir)
    return out_dir


def _write_text_encoder(folder: Path, text_encoder: torch.nn.Module) -> None:
    """Replace save_pretrained's weights with the key names every transformers version reads."""
    for stale in folder.glob("model*.safetensors*"):  # also a sharded save's index
        stale.unlink()
    state = {k: v.detach().contiguous() for k, v in text_encoder.state_dict().items()}
    write_safetensors(folder / "model.safetensors", text_encoder_keys(state), {"format": "pt"})


def _complete_tokenizer(folder: Path, tokenizer: object) -> None:
    """Add the slow CLIP tokenizer's files (transformers 4.x reads only these) from tokenizer.json."""
    fast = folder / "tokenizer.json"
    if fast.is_file() and not (folder / "vocab.json").is_file():
        model = json.loads(fast.read_text(encoding="utf-8"))["model"]
        (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {
        name: str(getattr(tokenizer, name))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, name, None) is not None
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
