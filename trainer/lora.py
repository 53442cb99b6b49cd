"""LoRA: low-rank adapters on the UNet (peft), trained while the base weights stay frozen.

    python -m trainer --model ./my-sd15 --set lora.rank=16 lora.alpha=16 data.source=./my-images

`lora.rank > 0` freezes the UNet and adds a pair of small matrices (A: rank x in, B: out x rank,
B starting at zero, so training starts from the base model exactly) to every layer whose name
ends with one of `lora.target_modules` (diffusers' attention projections by default, as in its
train_text_to_image_lora.py; add `proj_in`, `proj_out`, `ff.net.0.proj`, `ff.net.2` or conv layers
for a larger adapter). Each adapter's output is scaled by `alpha / rank`; `lora.dropout` drops
its input in training. Only the adapters require gradients, so DDP buckets, all-reduces and
the optimizer see nothing else, and every adapter is used in every step (no unused parameters).

A checkpoint holds the adapters (`unet_lora/...`), their optimizer state and a fingerprint of
the base UNet (`trainer.cache.module_fingerprint`): resuming on another base is refused (exit 2)
instead of silently pairing an adapter with weights it was not trained on.

The export (`trainer.export.export_lora`) writes `pytorch_lora_weights.safetensors`, which
diffusers' `pipe.load_lora_weights(folder)` reads; `alpha / rank` is folded into the B matrices,
so every diffusers version, which reads rank from the shapes and may not read alpha, loads the
adapter with the scale it was trained with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainer.models import ModelLoadError

if TYPE_CHECKING:
    from diffusers import UNet2DConditionModel

#: diffusers' train_text_to_image_lora.py default: the attention projections of every transformer block.
DEFAULT_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
ADAPTER = "default"  # peft's adapter name


class LoraError(ModelLoadError):
    """LoRA settings this model or environment cannot use (unknown target, peft missing). Exit code 2."""


@dataclass
class LoraConfig:
    """Low-rank adapters on the UNet instead of full fine-tuning (`[lora]`, see trainer/lora.py)."""

    rank: int = 0
    """Rank of every adapter; 0 trains the whole UNet (full fine-tuning)."""
    alpha: float = 0.0
    """Adapter output scale is alpha / rank; 0 means alpha = rank (scale 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """UNet layers that get an adapter: a layer matches when its name is, or ends with '.' + , an entry."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training."""
    export_merged: bool = False
    """Also export the UNet with the adapters merged into its weights (export/merged/, a full pipeline)."""


def enabled(cfg: LoraConfig) -> bool:
    return cfg.rank > 0


def matching_modules(module: torch.nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """target -> names of the layers it selects (peft's rule: the name, or a suffix after a dot)."""
    names = [name for name, _ in module.named_modules() if name]
    return {t: [n for n in names if n == t or n.endswith("." + t)] for t in targets}


def add_lora(unet: UNet2DConditionModel, cfg: LoraConfig) -> str | None:
    """Freeze `unet` and add the adapters; returns the base UNet's fingerprint (None when LoRA is off).

    LoraError (exit 2) for a target that selects no layer or a layer peft cannot adapt, or
    without peft installed.
    """
    if not enabled(cfg):
        return None
    from trainer.cache import module_fingerprint

    unknown = [t for t, found in matching_modules(unet, cfg.target_modules).items() if not found]
    if unknown:
        examples = sorted({_short_name(name) for name, m in unet.named_modules() if _adaptable(m)})
        raise LoraError(
            f"lora.target_modules {unknown} match no layer of this UNet; its Linear and Conv2d layers "
            f"end in: {', '.join(examples[:30])}"
        )
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise LoraError("lora.rank > 0 needs peft: pip install 'peft>=0.7'") from None
    base = module_fingerprint(unet)
    unet.requires_grad_(False)
    try:
        unet.add_adapter(
            PeftLoraConfig(
                r=cfg.rank,
                # peft annotates lora_alpha as int, yet only divides by it: a fractional alpha is valid
                lora_alpha=cfg.alpha or cfg.rank,  # type: ignore[arg-type]
                lora_dropout=cfg.dropout,
                target_modules=list(cfg.target_modules),
                init_lora_weights="gaussian",  # A random, B zero: the adapted UNet starts as the base
            ),
            adapter_name=ADAPTER,
        )
    except ValueError as exc:  # e.g. a target that is a whole block, not a Linear or Conv2d
        raise LoraError(f"lora.target_modules {cfg.target_modules}: {exc}") from None
    return base


def _short_name(name: str) -> str:
    """The part of a layer name a target gives: the last part, or two for a list entry (to_out.0)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _adaptable(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))


def describe_lora(unet: torch.nn.Module, cfg: LoraConfig) -> str:
    """One log line: what trains."""
    trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    return (
        f"LoRA rank {cfg.rank}, alpha {cfg.alpha or cfg.rank:g} on {len(lora_layers(unet))} layers "
        f"({', '.join(cfg.target_modules)}): {trainable:,} trainable parameters, the UNet's weights frozen"
    )


def lora_layers(unet: torch.nn.Module) -> dict[str, Any]:
    """name -> peft LoRA layer of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in unet.named_modules() if isinstance(m, LoraLayer)}


# -- checkpoints ------------------------------------------------------------------------------


def adapter_state(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors by their parameter names (what a LoRA checkpoint holds)."""
    return {name: p.detach() for name, p in unet.named_parameters() if p.requires_grad}


def unet_state(unet: torch.nn.Module, base_fingerprint: str | None) -> dict[str, Any]:
    """The UNet's part of a checkpoint: the whole UNet, or only the adapters and the base's fingerprint."""
    if base_fingerprint is None:
        return {"unet": unet.state_dict()}
    return {"unet_lora": adapter_state(unet), "lora_base": base_fingerprint}


def load_unet_state(unet: torch.nn.Module, shared: dict[str, Any], base_fingerprint: str | None) -> None:
    """Restore `unet_state`; ValueError naming the first mismatch (the trainer makes it exit 2)."""
    if base_fingerprint is None:
        if "unet" not in shared:
            raise ValueError("it holds LoRA adapters (unet_lora) and this run trains the whole UNet")
        unet.load_state_dict(shared["unet"])
        return
    if "unet_lora" not in shared:
        raise ValueError("it holds a whole UNet (full fine-tuning) and this run trains LoRA adapters")
    if shared.get("lora_base") != base_fingerprint:
        raise ValueError(
            "its adapters were trained on another base UNet (the base's fingerprint differs): resume with "
            "the --model or preset and train.seed it was saved with"
        )
    current = adapter_state(unet)
    saved = shared["unet_lora"]
    if set(saved) != set(current):
        missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise ValueError(
            f"its adapters differ from this run's lora settings (missing {missing[:2]}, unexpected {extra[:2]})"
        )
    with torch.no_grad():
        for name, tensor in current.items():
            if tuple(saved[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"adapter {name} has shape {tuple(saved[name].shape)}, this run {tuple(tensor.shape)}"
                )
            tensor.copy_(saved[name])


# -- export -----------------------------------------------------------------------------------


def diffusers_adapter(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as diffusers' `save_lora_weights` takes them (`...to_q.lora_A.weight`, peft's
    names without the adapter name), alpha / rank folded into B.

    Not converted to diffusers' older `lora.down`/`lora.up` names: that conversion renames only
    attention layers, and a file mixing both namings (with `proj_in` or `ff` targets) loads wrongly.
    """
    from peft.utils import get_peft_model_state_dict

    state = {k: v.detach().float().cpu().clone() for k, v in get_peft_model_state_dict(unet).items()}
    for name, layer in lora_layers(unet).items():
        key = f"{name}.lora_B.weight"
        if key in state:
            state[key] *= float(layer.scaling[ADAPTER])
    return state


def plain_unet(unet: UNet2DConditionModel, merge: bool) -> UNet2DConditionModel:
    """A UNet without peft layers: the frozen base weights, or with every adapter merged into them.

    Built on the meta device and filled from the tensors (no second random initialisation).
    """
    layers = lora_layers(unet)
    state = {}
    for key, value in unet.state_dict().items():
        if ".lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = value.detach()
    if merge:
        for name, layer in layers.items():
            key = f"{name}.weight"
            delta = layer.get_delta_weight(ADAPTER).to(dtype=torch.float32)
            state[key] = (state[key].float() + delta.reshape(state[key].shape)).to(state[key].dtype)
    with torch.device("meta"):
        plain = type(unet).from_config(copy.deepcopy(dict(unet.config)))
    plain.load_state_dict(state, strict=True, assign=True)
    return plain.train(unet.training)
