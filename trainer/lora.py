"""LoRA: low-rank adapters on the UNet (peft), and on request the text encoder's, trained while
the base weights stay frozen.

    python -m trainer --model ./my-sd15 --set lora.rank=16 lora.alpha=16 data.source=./my-images
    python -m trainer --model ./my-sd15 --set lora.rank=16 lora.text_encoder=true lora.text_encoder_lr=5e-5

`lora.rank > 0` freezes the UNet and adds a pair of small matrices (A: rank x in, B: out x rank,
B starting at zero, so training starts from the base model exactly) to every layer whose name
ends with one of `lora.target_modules` (diffusers' attention projections by default, as in its
train_text_to_image_lora.py; add `proj_in`, `proj_out`, `ff.net.0.proj`, `ff.net.2` or conv layers
for a larger adapter). Each adapter's output is scaled by `alpha / rank`; `lora.dropout` drops
its input in training. Only the adapters require gradients, so DDP buckets, all-reduces and
the optimizer see nothing else, and every adapter is used in every step (no unused parameters).

`lora.text_encoder=true` adds adapters of the same rank, alpha and dropout to the CLIP text
encoder's attention projections (`lora.text_encoder_targets`, as diffusers' DreamBooth LoRA
script), trained with their own learning rate (`lora.text_encoder_lr`, kohya's `text_encoder_lr`;
0 means optim.lr). The captions are then encoded in every step with gradients (`TextConditioned`
wraps encoder and UNet into the one module DDP synchronises); cached latents stay usable, cached
text embeddings are not used. A dropped caption becomes the empty caption's tokens, so caption
dropout trains the adapted encoder's "" as well.

A checkpoint holds the adapters (`unet_lora/...`, `text_encoder_lora/...`), their optimizer state
and a fingerprint of each base model (`trainer.cache.module_fingerprint`): resuming on another base is refused (exit 2)
instead of silently pairing an adapter with weights it was not trained on.

The export (`trainer.export.export_lora`) writes `pytorch_lora_weights.safetensors` (keys
`unet.` and `text_encoder.`), which diffusers' `pipe.load_lora_weights(folder)` reads; `alpha / rank` is folded into the B matrices,
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
#: diffusers' train_dreambooth_lora.py default for CLIP: the self-attention projections of every layer.
DEFAULT_TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
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
    text_encoder: bool = False
    """Also train adapters on the text encoder (same rank, alpha and dropout); needs rank > 0."""
    text_encoder_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TEXT_TARGETS))
    """Text encoder layers that get an adapter (same matching rule as target_modules)."""
    text_encoder_lr: float = 0.0
    """Learning rate of the text encoder's adapters; 0 means optim.lr."""


def enabled(cfg: LoraConfig) -> bool:
    return cfg.rank > 0


def text_encoder_trains(cfg: LoraConfig) -> bool:
    return enabled(cfg) and cfg.text_encoder


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
    return _add_adapters(unet, cfg, list(cfg.target_modules), "lora.target_modules", "UNet")


def add_text_encoder_lora(text_encoder: torch.nn.Module, cfg: LoraConfig) -> str | None:
    """Freeze the text encoder, and add its adapters when lora.text_encoder is on; returns the base
    encoder's fingerprint, else None (frozen, without adapters). LoraError as `add_lora`.

    The one place that decides what of the text encoder trains: the trainer never trains its weights.
    """
    if not text_encoder_trains(cfg):
        text_encoder.requires_grad_(False)
        return None
    targets = list(cfg.text_encoder_targets)
    return _add_adapters(text_encoder, cfg, targets, "lora.text_encoder_targets", "text encoder")


def _add_adapters(module: Any, cfg: LoraConfig, targets: list[str], key: str, what: str) -> str:
    from trainer.cache import module_fingerprint

    unknown = [t for t, found in matching_modules(module, targets).items() if not found]
    if unknown:
        examples = sorted({_short_name(name) for name, m in module.named_modules() if _adaptable(m)})
        raise LoraError(
            f"{key} {unknown} match no layer of this {what}; its Linear and Conv2d layers "
            f"end in: {', '.join(examples[:30])}"
        )
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise LoraError("lora.rank > 0 needs peft: pip install 'peft>=0.7'") from None
    base = module_fingerprint(module)
    module.requires_grad_(False)
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        # peft annotates lora_alpha as int, yet only divides by it: a fractional alpha is valid
        lora_alpha=cfg.alpha or cfg.rank,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=targets,
        init_lora_weights="gaussian",  # A random, B zero: the adapted model starts as the base
    )
    try:
        if _is_diffusers_model(module):
            module.add_adapter(peft_config, adapter_name=ADAPTER)
        else:
            # transformers' own add_adapter pins a newer peft than diffusers needs; injecting
            # the layers directly is what it does underneath, with any peft diffusers accepts.
            from peft import inject_adapter_in_model

            inject_adapter_in_model(peft_config, module, adapter_name=ADAPTER)
            for name, p in module.named_parameters():
                p.requires_grad_(".lora_" in name)
    except ValueError as exc:  # e.g. a target that is a whole block, not a Linear or Conv2d
        raise LoraError(f"{key} {targets}: {exc}") from None
    return base


def _is_diffusers_model(module: Any) -> bool:
    from diffusers import ModelMixin

    return isinstance(module, ModelMixin)


def keep_adapters_fp32(module: torch.nn.Module) -> None:
    """Adapters in fp32 after their frozen base was cast to bf16/fp16: the optimizer updates them in
    fp32 (peft casts each adapter's input to its dtype and the sum back to the base's)."""
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


class TextConditioned(torch.nn.Module):
    """Text encoder then UNet as one module: `(noisy, t, input_ids) -> UNet output`, so DDP
    synchronises both models' adapters in one set of buckets."""

    def __init__(self, unet: torch.nn.Module, text_encoder: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, input_ids: torch.Tensor) -> Any:
        hidden = self.text_encoder(input_ids)[0]
        return self.unet(noisy, timesteps, hidden)


def _short_name(name: str) -> str:
    """The part of a layer name a target gives: the last part, or two for a list entry (to_out.0)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _adaptable(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))


def describe_lora(unet: torch.nn.Module, cfg: LoraConfig, text_encoder: torch.nn.Module | None = None) -> str:
    """One log line: what trains."""
    trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    line = (
        f"LoRA rank {cfg.rank}, alpha {cfg.alpha or cfg.rank:g} on {len(lora_layers(unet))} layers "
        f"({', '.join(cfg.target_modules)}): {trainable:,} trainable parameters, the UNet's weights frozen"
    )
    if text_encoder is not None and text_encoder_trains(cfg):
        text = sum(p.numel() for p in text_encoder.parameters() if p.requires_grad)
        line += (
            f"; text encoder: {len(lora_layers(text_encoder))} layers ({', '.join(cfg.text_encoder_targets)}), "
            f"{text:,} trainable parameters"
        )
    return line


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
    _load_adapters(unet, shared["unet_lora"], "")


def text_encoder_state(text_encoder: torch.nn.Module, base_fingerprint: str | None) -> dict[str, Any]:
    """The text encoder's adapters and its base's fingerprint for a checkpoint; {} when they do not train."""
    if base_fingerprint is None:
        return {}
    return {"text_encoder_lora": adapter_state(text_encoder), "text_encoder_lora_base": base_fingerprint}


def load_text_encoder_state(
    text_encoder: torch.nn.Module, shared: dict[str, Any], base_fingerprint: str | None
) -> None:
    """Restore `text_encoder_state`; ValueError when the checkpoint and this run disagree on it."""
    saved = shared.get("text_encoder_lora")
    if base_fingerprint is None:
        if saved is not None:
            raise ValueError("it holds text encoder adapters and this run does not train them (lora.text_encoder)")
        return
    if saved is None:
        raise ValueError("it holds no text encoder adapters and this run trains them (lora.text_encoder=true)")
    if shared.get("text_encoder_lora_base") != base_fingerprint:
        raise ValueError(
            "its text encoder adapters were trained on another base text encoder: resume with the --model "
            "or preset and train.seed it was saved with"
        )
    _load_adapters(text_encoder, saved, "text encoder ")


def _load_adapters(module: torch.nn.Module, saved: dict[str, torch.Tensor], what: str) -> None:
    current = adapter_state(module)
    if set(saved) != set(current):
        missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        raise ValueError(
            f"its {what}adapters differ from this run's lora settings (missing {missing[:2]}, "
            f"unexpected {extra[:2]})"
        )
    with torch.no_grad():
        for name, tensor in current.items():
            if tuple(saved[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{what}adapter {name} has shape {tuple(saved[name].shape)}, this run {tuple(tensor.shape)}"
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
    with torch.device("meta"):
        plain = type(unet).from_config(copy.deepcopy(dict(unet.config)))
    return _filled(plain, unet, merge)


def plain_text_encoder(text_encoder: Any, merge: bool) -> Any:
    """The text encoder without peft layers (its base weights, or with the adapters merged), as
    `plain_unet`; the encoder itself when it has no adapters."""
    if not lora_layers(text_encoder):
        return text_encoder
    with torch.device("meta"):
        plain = type(text_encoder)(copy.deepcopy(text_encoder.config))
    return _filled(plain, text_encoder, merge)


def _filled(plain: Any, adapted: torch.nn.Module, merge: bool) -> Any:
    """`plain` (an empty copy of `adapted`'s architecture) given `adapted`'s base weights, plus
    each adapter's delta when `merge`."""
    state = {}
    for key, value in adapted.state_dict().items():
        if ".lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = value.detach()
    if merge:
        for name, layer in lora_layers(adapted).items():
            key = f"{name}.weight"
            delta = layer.get_delta_weight(ADAPTER).to(dtype=torch.float32)
            state[key] = (state[key].float() + delta.reshape(state[key].shape)).to(state[key].dtype)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    # transformers' CLIP registers position_ids as a non-persistent buffer: not in the state dict,
    # so it is left on the meta device by the load; it is a fixed arange.
    adapted_buffers = dict(adapted.named_buffers())
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:
            owner = plain.get_submodule(name.rpartition(".")[0]) if "." in name else plain
            leaf = name.rpartition(".")[2]
            source = adapted_buffers[_adapted_name(name, adapted_buffers)]
            owner.register_buffer(leaf, source.detach().clone(), persistent=False)
    if unexpected or [k for k in missing if k not in dict(plain.named_buffers())]:
        raise ValueError(f"cannot rebuild the model without adapters: missing {missing}, unexpected {unexpected}")
    return plain.train(adapted.training)


def _adapted_name(name: str, buffers: dict[str, torch.Tensor]) -> str:
    """A plain module's buffer name among the adapted module's `buffers` (peft puts base layers
    under base_layer)."""
    if name in buffers:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], "base_layer", parts[-1]])
