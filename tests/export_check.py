"""Reload a trainer export with whatever diffusers/transformers this interpreter has; compare tensors.

    python tests/export_check.py EXPORT_DIR REFERENCE.safetensors SINGLE_FILE.safetensors

REFERENCE holds the trainer's weights as `unet/<name>`, `vae/<name>`, `text_encoder/<name>`.
Loads EXPORT_DIR with `StableDiffusionPipeline.from_pretrained`, and the single file with
`from_single_file(config=<a copy of EXPORT_DIR holding only its .json/.txt files>)`, so the
weights can only come from the single file; offline (HF_HUB_OFFLINE=1, local_files_only).
Prints one JSON object (versions, per-loader differences, token ids of a few prompts) and exits
0 when every tensor of both loads equals the reference, 1 otherwise. Run by
tests/test_trainer_run.py under the test interpreter and, when SDDOCTOR_HF_OLDEST_PYTHON names
one, under the oldest transformers/diffusers pyproject allows (docs/trainer.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

PROMPTS = ["a handwritten digit seven", "the digit zero, written by hand", "an astronaut riding a horse!"]


def differences(module, reference: dict, prefix: str) -> list[str]:
    import torch

    def plain(key: str) -> str:
        return key.removeprefix("text_model.")

    loaded = {plain(k): v for k, v in module.state_dict().items() if not k.endswith("position_ids")}
    wanted = {plain(k[len(prefix) :]): v for k, v in reference.items() if k.startswith(prefix)}
    problems = [f"{prefix}{k}: missing" for k in sorted(set(wanted) - set(loaded))]
    problems += [f"{prefix}{k}: not in the trainer's weights" for k in sorted(set(loaded) - set(wanted))]
    for key in sorted(set(wanted) & set(loaded)):
        a, b = loaded[key], wanted[key]
        if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
            problems.append(f"{prefix}{key}: values differ")
    return problems


def check(pipe, reference: dict) -> list[str]:
    return (
        differences(pipe.unet, reference, "unet/")
        + differences(pipe.vae, reference, "vae/")
        + differences(pipe.text_encoder, reference, "text_encoder/")
    )


def main() -> int:
    import diffusers
    import transformers
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    export, reference_file, single = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    reference = load_file(reference_file)
    result: dict = {"diffusers": diffusers.__version__, "transformers": transformers.__version__}
    pipe = StableDiffusionPipeline.from_pretrained(export, local_files_only=True)
    result["from_pretrained"] = check(pipe, reference)
    result["tokenizer"] = type(pipe.tokenizer).__name__
    result["token_ids"] = [pipe.tokenizer(p).input_ids for p in PROMPTS]
    result["scaling_factor"] = pipe.vae.config.scaling_factor
    with tempfile.TemporaryDirectory() as tmp:
        configs = Path(tmp) / "configs"
        for path in export.rglob("*"):
            if path.is_file() and path.suffix in (".json", ".txt"):
                target = configs / path.relative_to(export)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
        pipe = StableDiffusionPipeline.from_single_file(single, config=str(configs), local_files_only=True)
        result["from_single_file"] = check(pipe, reference)
        result["single_file_scaling_factor"] = pipe.vae.config.scaling_factor
    print(json.dumps(result))
    return 0 if not result["from_pretrained"] and not result["from_single_file"] else 1


if __name__ == "__main__":
    sys.exit(main())
