"""The four parts of a Stable Diffusion model, built from a preset or loaded from a local folder.

Presets build real architectures with random weights (no downloads):

    tiny      a few hundred thousand parameters; trains on 2 CPU cores in a minute or two
    sd15      Stable Diffusion 1.5 (UNet 859.5M, VAE 83.7M, CLIP ViT-L/14 text encoder 123.1M)
    sd2-base  Stable Diffusion 2 base (UNet 865.9M, VAE 83.7M, OpenCLIP-H text encoder 23 layers 340.4M)
    sd2       Stable Diffusion 2 (768-v): sd2-base's architecture, v-prediction, 768 px

`model.path` loads a diffusers folder (unet/ vae/ text_encoder/ tokenizer/ scheduler/) instead.
Presets bring a tokenizer written from code: CLIP's byte-level alphabet plus whole-word merges
for the words of the built-in captions. Its ids fit any CLIP text encoder's vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # Any to mypy (pyproject.toml says why), yet the names say what each part is
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

PRESET_NAMES = ("tiny", "sd15", "sd2-base", "sd2")

_SD_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    steps_offset=1,
    prediction_type="epsilon",
)

_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=512,
    scaling_factor=0.18215,
)

_SD_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    block_out_channels=[320, 640, 1280, 1280],
    layers_per_block=2,
    norm_num_groups=32,
)

#: Architectures per preset: keyword arguments of the diffusers/transformers config classes.
ARCHITECTURES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "unet": dict(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
            block_out_channels=[32, 64],
            layers_per_block=1,
            norm_num_groups=8,
            cross_attention_dim=32,
            attention_head_dim=8,
        ),
        "vae": dict(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 3,
            up_block_types=["UpDecoderBlock2D"] * 3,
            block_out_channels=[16, 32, 32],
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=32,
            scaling_factor=1.0,
        ),
        "text_encoder": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
            projection_dim=32,
            hidden_act="quick_gelu",
        ),
        "scheduler": dict(_SD_SCHEDULER),
        "tokenizer": dict(model_max_length=16),
    },
    "sd15": {
        "unet": dict(_SD_UNET, cross_attention_dim=768, attention_head_dim=8),
        "vae": dict(_SD_VAE),
        "text_encoder": dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            projection_dim=768,
            hidden_act="quick_gelu",
            vocab_size=49408,
        ),
        "scheduler": dict(_SD_SCHEDULER),
        "tokenizer": dict(model_max_length=77),
    },
    "sd2-base": {
        "unet": dict(
            _SD_UNET,
            cross_attention_dim=1024,
            attention_head_dim=[5, 10, 20, 20],
            use_linear_projection=True,
        ),
        "vae": dict(_SD_VAE),
        "text_encoder": dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=23,
            num_attention_heads=16,
            max_position_embeddings=77,
            projection_dim=512,
            hidden_act="gelu",
            vocab_size=49408,
        ),
        "scheduler": dict(_SD_SCHEDULER),
        "tokenizer": dict(model_max_length=77),
    },
}

#: Words of the built-in captions, each merged into one token by the preset tokenizer.
_WORDS = (
    "a an the of photo picture handwritten digit number zero one two three four five six seven "
    "eight nine written by hand astronaut riding horse"
).split()


class ModelLoadError(ValueError):
    """A model folder that is missing or incomplete, or settings the model cannot run with. Exit code 2."""


@dataclass
class Models:
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: Any
    noise_scheduler: Any
    from_scratch: bool
    """True when built from a preset with random weights (the VAE then needs fitting)."""
    source: str


def build_models(preset: str, path: str = "", prediction_type: str = "") -> Models:
    """The preset's architecture with random weights, or the diffusers folder at `path`."""
    if path:
        models = load_models(path)
    else:
        if preset not in ARCHITECTURES:
            raise ModelLoadError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESET_NAMES)}")
        arch = ARCHITECTURES[preset]
        tokenizer = build_tokenizer(**arch["tokenizer"])
        models = Models(
            unet=build_unet(arch["unet"]),
            vae=build_vae(arch["vae"]),
            text_encoder=build_text_encoder(arch["text_encoder"], tokenizer),
            tokenizer=tokenizer,
            noise_scheduler=build_scheduler(arch["scheduler"]),
            from_scratch=True,
            source=f"preset:{preset}",
        )
    if prediction_type:
        models.noise_scheduler.register_to_config(prediction_type=prediction_type)
    return models


def build_unet(kwargs: dict[str, Any]) -> UNet2DConditionModel:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**kwargs)


def build_vae(kwargs: dict[str, Any]) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    return AutoencoderKL(**kwargs)


def build_text_encoder(kwargs: dict[str, Any], tokenizer: Any = None) -> CLIPTextModel:
    from transformers import CLIPTextConfig, CLIPTextModel

    kwargs = dict(kwargs)
    if tokenizer is not None:
        kwargs.setdefault("vocab_size", len(tokenizer))
        kwargs.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return CLIPTextModel(CLIPTextConfig(**kwargs))


def build_scheduler(kwargs: dict[str, Any]) -> Any:
    from diffusers import DDPMScheduler

    return DDPMScheduler(**kwargs)


def build_tokenizer(model_max_length: int = 77) -> Any:
    """A CLIP tokenizer written from code: byte alphabet (+ end-of-word forms) and whole-word merges."""
    from transformers import CLIPTokenizer

    alphabet = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for symbol in alphabet + [c + "</w>" for c in alphabet]:
        vocab[symbol] = len(vocab)
    merges: list[str] = []
    for word in _WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merge = f"{parts[0]} {parts[1]}"
            if merge not in merges:
                merges.append(merge)
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        return CLIPTokenizer(
            str(Path(tmp) / "vocab.json"),
            str(Path(tmp) / "merges.txt"),
            model_max_length=model_max_length,
            pad_token="<|endoftext|>",
        )


def _bytes_to_unicode() -> list[str]:
    """CLIP's (and GPT-2's) reversible map of the 256 byte values onto printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


_PARTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def load_models(path: str) -> Models:
    """Load a local diffusers folder; a missing part is a ModelLoadError that names it."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(
            f"model folder {path} does not exist (expected a diffusers folder with {', '.join(_PARTS)})"
        )
    missing = [p for p in _PARTS if not (root / p).is_dir()]
    if missing:
        raise ModelLoadError(
            f"model folder {path} lacks {', '.join(p + '/' for p in missing)}; a diffusers folder "
            f"(e.g. one written by `python -m trainer` under export/) has {', '.join(_PARTS)}"
        )
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    try:
        return Models(
            unet=UNet2DConditionModel.from_pretrained(root / "unet"),
            vae=AutoencoderKL.from_pretrained(root / "vae"),
            text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder"),
            tokenizer=CLIPTokenizer.from_pretrained(root / "tokenizer"),
            noise_scheduler=DDPMScheduler.from_pretrained(root / "scheduler"),
            from_scratch=False,
            source=str(root),
        )
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot load the model folder {path}: {exc}") from None


def vae_scale_factor(vae: AutoencoderKL) -> int:
    """Pixels per latent along each side (8 for Stable Diffusion's VAE, 4 for the tiny preset's)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def check_model_fits(models: Models, resolution: int, sample_steps: int) -> None:
    """ModelLoadError when the resolution or the sampling steps do not suit these models."""
    factor = vae_scale_factor(models.vae)
    if resolution % factor:
        raise ModelLoadError(
            f"data.resolution={resolution} is not a multiple of {factor}, the downsampling factor of the VAE "
            f"of {models.source}; use a multiple of {factor}"
        )
    timesteps = int(models.noise_scheduler.config.num_train_timesteps)
    if sample_steps > timesteps:
        raise ModelLoadError(
            f"sample.steps={sample_steps} is more than the {timesteps} timesteps the noise schedule of "
            f"{models.source} has; use at most {timesteps}"
        )


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_on_meta(preset: str) -> dict[str, torch.nn.Module]:
    """The preset's networks on the meta device (no memory, no init): for parameter counts."""
    arch = ARCHITECTURES[preset]
    with torch.device("meta"):
        return {
            "unet": build_unet(arch["unet"]),
            "vae": build_vae(arch["vae"]),
            "text_encoder": build_text_encoder(arch["text_encoder"]),
        }


#: model.attention_backend -> the one SDPA kernel the UNet may use
_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def attention_kernel_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """A context in which F.scaled_dot_product_attention (diffusers' AttnProcessor2_0) may use
    only the named kernel; `auto` leaves PyTorch's choice alone. Scoped, not process-wide: the
    VAE's fp32 attention has no flash kernel ("Invalid backend" with flash alone, on an H200)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[name])])


class OnlyAttentionKernel(torch.nn.Module):
    """Runs `module` with only one attention kernel allowed (model.attention_backend)."""

    def __init__(self, module: torch.nn.Module, backend: str) -> None:
        super().__init__()
        self.module = module
        self.backend = backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with attention_kernel_scope(self.backend):
            return self.module(*args, **kwargs)


def separate_compile_cache(backend: str) -> None:
    """Give each attention backend a compile cache of its own. A compiled graph fixes its
    attention kernel when it is traced, and Inductor's on-disk cache does not count the kernel
    switches in its key: a graph compiled earlier with another backend was reused as it was
    (measured: `flash` ran cuDNN's kernels)."""
    if backend != "auto":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(inductor_cache_dir()) / f"sdpa-{backend}")


def compile_arguments(backend: str, mode: str, entries: list[str]) -> dict[str, Any]:
    """torch.compile's `mode=` or `options=` for model.compile_mode and model.compile_options.
    torch.compile takes one or the other, so with options the mode's own settings are merged in.
    An unknown name, a value of the wrong type, or options for a backend other than Inductor
    (which would ignore them) raise ConfigError (exit 2) naming it."""
    if not entries:
        return {"mode": mode or None}
    import torch._inductor
    import torch._inductor.config

    from trainer.config import ConfigError

    if backend != "inductor":
        raise ConfigError(
            f"model.compile_options are Inductor settings; model.compile_backend is {backend!r}: "
            "use model.compile_backend=inductor or leave model.compile_options empty"
        )
    known = torch._inductor.config.get_config_copy()
    options: dict[str, Any] = dict(torch._inductor.list_mode_options(mode or "default"))
    for entry in entries:
        name, _, text = entry.partition("=")
        if name not in known:
            raise ConfigError(
                f"model.compile_options: {name!r} is not an Inductor setting of torch {torch.__version__}; "
                "names are those of torch._inductor.config, e.g. triton.prefer_nd_tiling"
            )
        options[name] = _option_value(name, text, known[name])
    return {"options": options}


def _option_value(name: str, text: str, current: Any) -> Any:
    """`text` read as the type of the setting's current value (a bool, int, float or text)."""
    from trainer.config import ConfigError

    words = {"true": True, "false": False}
    if isinstance(current, bool) or (current is None and text.lower() in words):
        if text.lower() not in words:
            raise ConfigError(f"model.compile_options: {name} takes true or false, not {text!r}")
        return words[text.lower()]
    for kind in (int, float):
        if isinstance(current, kind) or current is None:
            try:
                return kind(text)
            except ValueError:
                if current is not None:
                    raise ConfigError(f"model.compile_options: {name} takes a number, not {text!r}") from None
    if current is None or isinstance(current, str):
        return text
    raise ConfigError(f"model.compile_options: {name} is not a setting that takes a plain value")


def inductor_cache_dir() -> str:
    """Where Inductor keeps what it compiled: TORCHINDUCTOR_CACHE_DIR, or its default under the
    temporary folder."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen:
        return chosen
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return default_cache_dir()
    except (ImportError, KeyError, OSError):  # older torch; no user name for this uid
        return str(Path(tempfile.gettempdir()) / "torchinductor_sddoctor")


def side_step(models: Models) -> int:
    """The step image sides must be multiples of: the VAE's factor times the UNet's downsampling
    (64 px for Stable Diffusion, 8 for the tiny preset)."""
    return vae_scale_factor(models.vae) * 2 ** (len(models.unet.config.block_out_channels) - 1)


# Stable Diffusion 2 (768-v): the same networks as 2-base; the noise is predicted as v, at 768 px.
ARCHITECTURES["sd2"] = {
    **ARCHITECTURES["sd2-base"],
    "unet": dict(ARCHITECTURES["sd2-base"]["unet"], sample_size=96),
    "vae": dict(_SD_VAE, sample_size=768),
    "scheduler": dict(_SD_SCHEDULER, prediction_type="v_prediction"),
}
