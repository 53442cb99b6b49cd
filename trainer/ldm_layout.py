"""Stable Diffusion's original single-file layout (the CompVis/LDM key names) from diffusers' modules.

A single `.safetensors` file in this layout is what `StableDiffusionPipeline.from_single_file`
(and the UIs built on the original repository) read:

    model.diffusion_model.*                  the UNet (openaimodel.UNetModel names)
    first_stage_model.*                      the VAE (AutoencoderKL of ldm.models.autoencoder)
    cond_stage_model.transformer.text_model.*  the CLIP text encoder (transformers' CLIPTextModel names)

The maps below are the inverse of diffusers' own converters (`convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint`); they are derived from the keys
present, so any depth of UNet or VAE with one `layers_per_block` for all blocks converts.
Every key is mapped exactly once, or `ValueError` names the one that is not.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_PREFIX = "cond_stage_model.transformer."

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def text_encoder_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' CLIPTextModel keys as every version reads them (`text_model.` prefix).

    transformers 5 names the parameters without the prefix; 4.x needs it and silently builds a
    random text encoder from a file without it. 5.x reads either.
    """
    return {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in state.items()}


def _renamed(
    state: dict[str, torch.Tensor], rename: Callable[[str], str | None], what: str
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        new = rename(key)
        if new is None:
            raise ValueError(f"no original-layout name for the {what} parameter {key!r}")
        if new in out:
            raise ValueError(f"two {what} parameters map to {new!r}")
        out[new] = value
    return out


def _blocks(state: dict[str, torch.Tensor], pattern: str) -> dict[int, set[int]]:
    """{block index: {layer indices}} of keys matching `pattern` (with groups block, layer)."""
    found: dict[int, set[int]] = {}
    for key in state:
        m = re.match(pattern, key)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def unet_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers UNet2DConditionModel state dict -> `model.diffusion_model.*` keys."""
    prefixes: dict[str, str] = {
        "conv_in.": "input_blocks.0.0.",
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
        "mid_block.resnets.0.": "middle_block.0.",
        "mid_block.attentions.0.": "middle_block.1.",
        "mid_block.resnets.1.": "middle_block.2.",
    }
    down = _blocks(state, r"down_blocks\.(\d+)\.resnets\.(\d+)\.")
    index = 1
    for block in sorted(down):
        for layer in sorted(down[block]):
            prefixes[f"down_blocks.{block}.resnets.{layer}."] = f"input_blocks.{index}.0."
            prefixes[f"down_blocks.{block}.attentions.{layer}."] = f"input_blocks.{index}.1."
            index += 1
        if any(k.startswith(f"down_blocks.{block}.downsamplers.0.") for k in state):
            prefixes[f"down_blocks.{block}.downsamplers.0.conv."] = f"input_blocks.{index}.0.op."
            index += 1
    up = _blocks(state, r"up_blocks\.(\d+)\.resnets\.(\d+)\.")
    index = 0
    for block in sorted(up):
        layers = sorted(up[block])
        has_attention = any(k.startswith(f"up_blocks.{block}.attentions.") for k in state)
        for layer in layers:
            prefixes[f"up_blocks.{block}.resnets.{layer}."] = f"output_blocks.{index}.0."
            prefixes[f"up_blocks.{block}.attentions.{layer}."] = f"output_blocks.{index}.1."
            if layer == layers[-1]:
                slot = 2 if has_attention else 1
                prefixes[f"up_blocks.{block}.upsamplers.0.conv."] = f"output_blocks.{index}.{slot}.conv."
            index += 1

    def rename(key: str) -> str | None:
        for old, new in prefixes.items():
            if key.startswith(old):
                rest = key[len(old) :]
                if ".resnets." in old:
                    name, _, param = rest.rpartition(".")
                    if name not in _UNET_RESNET:
                        return None
                    rest = f"{_UNET_RESNET[name]}.{param}"
                return UNET_PREFIX + new + rest
        return None

    return _renamed(state, rename, "UNet")


def vae_to_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKL state dict -> `first_stage_model.*` keys (attention as 1x1 convs)."""
    ups = _blocks(state, r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.")
    last = max(ups) if ups else 0

    def rename(key: str) -> str | None:
        key = key.replace("conv_norm_out.", "norm_out.").replace("conv_shortcut.", "nin_shortcut.")
        key = key.replace("mid_block.resnets.0.", "mid.block_1.").replace(
            "mid_block.resnets.1.", "mid.block_2."
        )
        key = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", key)
        key = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", key)
        key = re.sub(
            r"^decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
            lambda m: (
                f"decoder.up.{last - int(m.group(1))}.{'block' if m.group(2) == 'resnets' else 'upsample'}."
            ),
            key,
        )
        m = re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)$", key)
        if m:
            if m.group(2) not in _VAE_ATTENTION:
                return None
            key = f"{m.group(1)}.mid.attn_1.{_VAE_ATTENTION[m.group(2)]}.{m.group(3)}"
        if "_blocks." in key or "mid_block." in key:
            return None
        return VAE_PREFIX + key

    out = _renamed(state, rename, "VAE")
    for key, value in out.items():
        # The original VAE's attention projections are 1x1 convolutions: [C, C] -> [C, C, 1, 1].
        if ".mid.attn_1." in key and key.endswith(".weight") and value.dim() == 2:
            out[key] = value[:, :, None, None]
    return out


def single_file_state(
    unet: dict[str, torch.Tensor], vae: dict[str, torch.Tensor], text_encoder: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The whole pipeline's weights in the original single-file layout."""
    state = unet_to_ldm(unet)
    state.update(vae_to_ldm(vae))
    state.update({TEXT_PREFIX + k: v for k, v in text_encoder_keys(text_encoder).items()})
    return state
