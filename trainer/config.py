"""The trainer's configuration: a typed dataclass tree and the layers that fill it.

Resolution order, later wins:

    dataclass defaults  <-  preset (`--preset` / model.preset)  <-  `--config run.toml`  <-  `--set a.b=v`

Every key is checked against the tree: an unknown key or a value of the wrong type raises
`ConfigError` naming the key and the valid ones; the command line turns that into exit code 2.
`--config` needs Python 3.11+ (tomllib) or the `tomli` package on 3.10.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data import DataConfig
from trainer.lora import LoraConfig
from trainer.step_profile import parse_steps


class ConfigError(ValueError):
    """Bad user configuration (unknown key, wrong type, unreadable file). Exit code 2."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """tiny | sd15 | sd2-base: architecture built with random weights."""
    path: str = ""
    """A local diffusers folder (unet/ vae/ text_encoder/ tokenizer/ scheduler/); overrides the preset's weights."""
    vae_warmup_steps: int = 0
    """Steps of VAE reconstruction training before the UNet trains (only for a VAE built from scratch)."""
    vae_warmup_batch: int = 16
    """Images per rank per VAE fitting step."""
    vae_warmup_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    prediction_type: str = ""
    """epsilon | v_prediction; empty keeps the noise scheduler's own setting."""
    gradient_checkpointing: bool = False
    channels_last: bool = True
    keep_channels_last: bool = True
    """With channels_last: the UNet's resnet blocks and transformers skip diffusers' NCHW copies of
    their activations (trainer/unet_layout.py); false keeps diffusers' own forward, for comparison."""
    compile: str = "false"
    """true | false | auto (true when training on CUDA; the SD presets' setting): torch.compile the
    UNet. The first steps are slow while it compiles (about two minutes for SD2-base)."""
    compile_backend: str = "inductor"
    """torch.compile backend: inductor (generates kernels) | aot_eager | eager (no code generation:
    for telling a compile problem from a kernel problem, and fast to start)."""
    compile_mode: str = ""
    """torch.compile mode: '' (default) | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs."""
    compile_options: list[str] = field(default_factory=list)
    """Inductor settings as NAME=VALUE, NAME as in torch._inductor.config (e.g.
    triton.prefer_nd_tiling=true), added to compile_mode's own: for measuring a compiler lever."""
    unet_dtype: str = "fp32"
    """fp32 (under autocast) | bf16 (bf16 weights, no autocast; the optimizer keeps fp32 master weights
    unless optim.master_weights=false) | auto (bf16 when training in bf16 on CUDA, else fp32)."""
    init_on_device: bool = True
    """Create preset models with random weights directly on the GPU (seconds instead of a minute on the host)."""
    offload_frozen: bool = False
    """With data.cache: move the VAE and text encoder to host memory once the cache is built."""
    attention_backend: str = "auto"
    """auto (PyTorch picks per call) | flash | cudnn | efficient | math: the only kernel
    F.scaled_dot_product_attention may use (CUDA; for measuring attention's share of the step)."""


@dataclass
class TrainConfig:
    seed: int = 0
    max_steps: int = 200
    """Optimizer steps."""
    micro_batch: int = 16
    """Images per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; global batch = micro_batch x grad_accum x world size."""
    mixed_precision: str = "auto"
    """auto (bf16 on CUDA with bf16 support, else fp32) | bf16 | fp16 | fp32."""
    max_grad_norm: float = 1.0
    """Gradient clipping; 0 turns it off."""
    ema_decay: float = 0.0
    """EMA of the UNet weights (e.g. 0.999); 0 turns it off."""
    ema_dtype: str = "fp32"
    """fp32 | bf16: dtype of the EMA copy (bf16 halves it and rounds its updates stochastically)."""
    min_snr_gamma: float = 0.0
    """Min-SNR loss weighting (5.0 is the paper's value); 0 turns it off."""
    noise_offset: float = 0.0
    caption_dropout: float = 0.1
    """Probability of training on the empty caption, which classifier-free guidance needs."""
    log_every: int = 10
    """Steps between loss read-backs (one host sync each) and progress lines."""
    cudnn_benchmark: bool = True
    """Let cuDNN time its convolution algorithms for the UNet's fixed shapes (CUDA)."""
    tf32: bool = True
    """TF32 for the fp32 matmuls and convolutions that remain (CUDA, Ampere and newer)."""
    memory_saver: bool = False
    """Fit small GPUs: the MEMORY_SAVER settings below, for every key not set explicitly."""
    oom_guard: bool = True
    """Recover from out-of-memory in flight: every rank lowers the micro-batch and raises
    accumulation (same global batch) and redoes the step (sddoctor.instrument.oom_guard)."""
    oom_fallback_checkpointing: bool = True
    """When micro-batch 1 still runs out of memory, turn on gradient checkpointing before giving up."""
    trace_collectives: bool = True
    """Trace torch.distributed collectives and run the heartbeat (sddoctor.instrument). Telemetry
    (step events, state) stays on either way; under `sddoctor run` tracing is on from the start."""
    profile_steps: str = ""
    """FIRST-LAST (1-based, e.g. 11-13): record these steps with torch.profiler and write where the
    time went, by kind of kernel, to OUTPUT_DIR/profile/ (trainer.step_profile); empty: off."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """adamw | adamw8bit (bitsandbytes' 8-bit AdamW: 2 bytes of moments per parameter instead of 8;
    CUDA only, `pip install 'sddoctor[bnb]'`; the UNet then keeps fp32 weights under autocast)."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    eps: float = 1e-8
    fused: str = "auto"
    """auto (fused AdamW on CUDA) | true | false."""
    state_dtype: str = "fp32"
    """fp32 | bf16: dtype of the Adam moments (bf16 uses trainer.memory.MixedPrecisionAdamW)."""
    master_weights: bool = True
    """With bf16 UNet weights: keep an fp32 master copy in the optimizer (false: stochastic rounding)."""
    schedule: str = "cosine"
    """cosine | constant (both after linear warmup)."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""


@dataclass
class DDPConfig:
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo."""
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    """Off for SD's UNet: every parameter gets a gradient, and the search costs a graph traversal per step."""
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    timeout_s: int = 1800


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints; 0 saves only at the end and on SIGTERM/SIGINT."""
    keep: int = 2
    """Checkpoints kept (oldest deleted first); 0 keeps all."""
    resume: str = ""
    """'' | latest | PATH of a checkpoint folder."""
    on_signal: bool = True
    at_end: bool = True
    reshard: bool = False
    """Resume a checkpoint saved by another number of ranks (or lacking a rank's file): weights,
    optimizer, LR schedule and data position carry over, the random streams restart."""


@dataclass
class SampleConfig:
    every: int = 0
    """Steps between sample grids; 0 samples only at the end (if prompts are set)."""
    at_end: bool = True
    prompts: list[str] = field(default_factory=list)
    images_per_prompt: int = 4
    steps: int = 25
    guidance_scale: float = 4.0
    seed: int = 1234


@dataclass
class OutputConfig:
    name: str = ""
    """Run name; the output dir is ./runs/<name>/ (default name: the preset)."""
    dir: str = ""
    """Output dir; default: $SDDOCTOR_RUN_DIR when set, else ./runs/<name>/."""
    export: bool = True
    """Write a diffusers folder (export/) at the end."""
    report_to: str = "tensorboard"
    """tensorboard (OUTPUT_DIR/tensorboard/) | wandb (offline with WANDB_MODE=offline) | all | none:
    where rank 0 writes loss, lr, throughput, memory, gradient norm and sample grids."""
    progress: str = "auto"
    """auto (a live bar on a terminal, a line per logging interval otherwise) | bar | lines | quiet
    (only warnings and errors)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


DIGIT_PROMPTS = [
    f"a handwritten digit {w}" for w in "zero one two three four five six seven eight nine".split()
]

#: What each preset changes on top of the dataclass defaults (dotted keys, like --set).


def _sd_settings() -> dict[str, Any]:
    """Training settings shared by the full-size presets (a fresh dict each: the list is not shared)."""
    return {
        "data.resolution": 512,
        "data.cache": True,
        "data.num_workers": 2,
        "model.unet_dtype": "auto",
        "model.compile": "auto",
        "train.micro_batch": 4,
        "train.mixed_precision": "auto",
        "train.ema_decay": 0.9999,
        "optim.lr": 1e-5,
        "optim.warmup_steps": 100,
        "sample.prompts": ["a photo of an astronaut riding a horse"],
    }


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model.vae_warmup_steps": 200,
        "data.resolution": 32,
        "data.random_flip": False,
        "train.max_steps": 300,
        "train.micro_batch": 32,
        "train.log_every": 20,
        "train.mixed_precision": "auto",
        "data.cache": True,
        "data.num_workers": 0,
        "optim.lr": 2e-3,
        "optim.warmup_steps": 20,
        "optim.weight_decay": 0.0,
        "sample.prompts": DIGIT_PROMPTS,
        "sample.images_per_prompt": 4,
        "sample.steps": 20,
        "sample.guidance_scale": 3.0,
    },
    "sd15": _sd_settings(),
    "sd2-base": _sd_settings(),
    "sd2": {**_sd_settings(), "data.resolution": 768},
}


#: What train.memory_saver=true sets, unless the key is given explicitly (--set, --config).
#: SD2-base at batch 4, 512 px: bf16 weights + bf16 gradients + bf16 moments (8 bytes per UNet
#: parameter, ~6.9 GB), activations recomputed in backward, VAE and text encoder off the GPU; with
#: EMA on (the SD presets' 0.9999), a bf16 EMA copy (2 more bytes per parameter instead of 4).
MEMORY_SAVER: dict[str, Any] = {
    "model.gradient_checkpointing": True,
    "model.unet_dtype": "bf16",
    "model.offload_frozen": True,
    "optim.state_dtype": "bf16",
    "optim.master_weights": False,
    "train.ema_dtype": "bf16",
    "data.cache": True,
}
#: The saver's keys that choose the optimizer's precision; left alone with optim.name=adamw8bit.
SAVER_PRECISION = ("model.unet_dtype", "optim.state_dtype", "optim.master_weights")


# -- building ------------------------------------------------------------------------------


def build_config(
    preset: str | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """Resolve defaults <- preset <- TOML file <- `key=value` overrides into a Config."""
    file_values: dict[str, Any] = {}
    if config_file:
        file_values = flatten(load_toml(config_file), source=config_file)
    set_values = dict(parse_override(o) for o in overrides or [])
    # The preset decides the defaults everything else refines, so find it first.
    chosen = set_values.get("model.preset") or preset or file_values.get("model.preset") or "tiny"
    if not isinstance(chosen, str) or chosen not in PRESETS:
        raise ConfigError(
            f"unknown preset {chosen!r} (config key 'model.preset'); valid presets: {', '.join(PRESETS)}"
        )
    cfg = Config()
    for key, value in PRESETS[chosen].items():
        set_key(cfg, key, value, source=f"preset {chosen}")
    for key, value in file_values.items():
        set_key(cfg, key, value, source=config_file)
    for key, raw in set_values.items():
        set_key(cfg, key, raw, source="--set", from_text=True)
    if cfg.train.memory_saver:
        for key, value in MEMORY_SAVER.items():
            if cfg.optim.name == "adamw8bit" and key in SAVER_PRECISION:
                continue  # 8-bit AdamW brings its own optimizer memory saving, on fp32 weights
            if key not in set_values and key not in file_values:
                set_key(cfg, key, value, source="train.memory_saver")
    cfg.model.preset = chosen
    validate(cfg)
    return cfg


def load_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "--config needs Python 3.11+ (tomllib) or `pip install tomli` on Python 3.10; "
                "or pass the values with --set key=value"
            ) from None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def flatten(tree: dict[str, Any], source: str, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; tables become dots, values stay as parsed."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, source, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key.sub=value, got {text!r} (e.g. --set train.max_steps=100)")
    return key.strip(), value.strip()


def set_key(cfg: Config, key: str, value: Any, source: str | None, from_text: bool = False) -> None:
    """Assign `value` to the dotted `key` of `cfg`, converting/checking it against the field's type."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(node)]
        where = ".".join(parts[:depth]) or "the top level"
        if part not in names:
            prefix = ".".join(parts[:depth])
            valid = ", ".join(f"{prefix}.{n}" if prefix else n for n in names)
            raise ConfigError(f"unknown config key {key!r} (from {source}); valid keys at {where}: {valid}")
        hint = typing.get_type_hints(type(node))[part]
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(hint):
                raise ConfigError(f"config key {key!r} (from {source}) is a section; set one of its keys")
            try:
                converted = convert(value, hint, from_text)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"config key {key!r} (from {source}) expects {type_name(hint)}, got {value!r}: {exc}"
                ) from None
            setattr(node, part, converted)
            return
        node = getattr(node, part)
        if not dataclasses.is_dataclass(node):
            raise ConfigError(
                f"config key {key!r} (from {source}): {'.'.join(parts[: depth + 1])} is not a section"
            )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def convert(value: Any, hint: Any, from_text: bool) -> Any:
    """Convert a TOML value or a --set string to the type `hint`; TypeError/ValueError when it cannot."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (from_text and str(value).lower() in ("none", "null", "")):
            return None
        return convert(value, options[0], from_text)
    if origin in (list, tuple):
        if from_text:
            text = str(value)
            if text.startswith("["):
                value = json.loads(text)
            elif origin is list:
                value = [p.strip() for p in text.split(";")] if text else []
            else:
                value = [p.strip() for p in text.split(",")]
        if not isinstance(value, (list, tuple)):
            raise TypeError("expected a list")
        args = typing.get_args(hint)
        if origin is tuple:
            if len(value) != len(args):
                raise ValueError(f"expected {len(args)} values")
            return tuple(convert(v, a, from_text) for v, a in zip(value, args, strict=True))
        return [convert(v, args[0], from_text) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise TypeError("expected true or false")
    if hint is int:
        if isinstance(value, bool):
            raise TypeError("expected an integer")
        if isinstance(value, int):
            return value
        if from_text:
            return int(str(value))
        raise TypeError("expected an integer")
    if hint is float:
        if isinstance(value, bool):
            raise TypeError("expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if from_text:
            return float(str(value))
        raise TypeError("expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # a switch that also takes "auto": TOML's true/false mean the same
            return "true" if value else "false"
        if from_text:
            return str(value)
        raise TypeError("expected a string")
    raise TypeError(f"unsupported type {hint}")


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        inner = ", ".join(type_name(a) for a in typing.get_args(hint))
        return f"{origin.__name__}[{inner}]"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


@dataclass(frozen=True)
class Rule:
    """What a config value may be: `check(value)` says whether it is, `allowed` says it in words."""

    check: Callable[[Any], bool]
    allowed: str


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(low: int, high: int, multiple: int = 1) -> Rule:
    words = f"an integer from {low:,} to {high:,}" + (f", a multiple of {multiple}" if multiple > 1 else "")
    return Rule(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high and v % multiple == 0,
        words,
    )


def _float(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False) -> Rule:
    if math.isinf(high):
        words = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        words = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return Rule(
        lambda v: (
            _number(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        ),
        words,
    )


def _choice(*options: str) -> Rule:
    return Rule(lambda v: v in options, "one of " + ", ".join(map(repr, options)))


def _text(nonempty: bool = False, what: str = "text") -> Rule:
    """Free text; never a NUL character (no path or caption can hold one)."""
    return Rule(
        lambda v: isinstance(v, str) and "\x00" not in v and (bool(v.strip()) or not nonempty),
        f"{'non-empty ' if nonempty else ''}{what} without NUL characters",
    )


def _optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.check(v), f"unset (empty) or {rule.allowed}")


def _each(rule: Rule, words: str) -> Rule:
    return Rule(lambda v: isinstance(v, (list, tuple)) and all(rule.check(x) for x in v), words)


_BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
_STEPS = _int(0, 10**9)
_SEED = _int(0, 2**32 - 1)
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_LAYER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


def _layer_names(example: str) -> Rule:
    return Rule(
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) and _LAYER_NAME.fullmatch(x) for x in v),
        f"a non-empty list of layer names (letters, digits, '_', dotted), e.g. {example}",
    )


_COMPILE_OPTION = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=[A-Za-z0-9_.+-]+")


def _optional_size(rule: Rule) -> Rule:
    """0 (derived from the model and data.resolution) or `rule`."""
    return Rule(
        lambda v: v == 0 and not isinstance(v, bool) or rule.check(v), f"0 (automatic) or {rule.allowed}"
    )


def _profile_steps(value: Any) -> bool:
    try:
        steps = parse_steps(value)
    except (ValueError, TypeError, AttributeError):
        return False
    return steps is None or steps[1] <= 10**9


#: Every leaf of the config tree and what it may hold. `validate` checks them all, in this order;
#: a field missing here is a programming error (tests/test_trainer_config_hostile.py walks the tree).
RULES: dict[str, Rule] = {
    "model.preset": _choice(*PRESETS),
    "model.path": _text(what="'' (the preset) or a folder path"),
    "model.vae_warmup_steps": _STEPS,
    "model.vae_warmup_batch": _int(1, 65536),
    "model.vae_warmup_lr": _float(0, low_open=True),
    "model.vae_kl_weight": _float(0, 1),
    "model.prediction_type": _choice("", "epsilon", "v_prediction"),
    "model.gradient_checkpointing": _BOOL,
    "model.channels_last": _BOOL,
    "model.keep_channels_last": _BOOL,
    "model.compile": _choice("true", "false", "auto"),
    "model.compile_backend": _choice("inductor", "aot_eager", "eager"),
    "model.compile_mode": _choice(
        "", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ),
    "model.unet_dtype": _choice("fp32", "bf16", "auto"),
    "model.init_on_device": _BOOL,
    "model.offload_frozen": _BOOL,
    "model.attention_backend": _choice("auto", "flash", "cudnn", "efficient", "math"),
    "model.compile_options": Rule(
        lambda v: isinstance(v, list) and all(isinstance(x, str) and _COMPILE_OPTION.fullmatch(x) for x in v),
        "a list of Inductor settings NAME=VALUE, e.g. triton.prefer_nd_tiling=true",
    ),
    "data.source": _text(nonempty=True, what="'digits' or a folder path"),
    "data.resolution": _int(8, 8192, multiple=8),
    "data.center_crop": _BOOL,
    "data.random_flip": _BOOL,
    "data.caption_column": _text(nonempty=True, what="a column name"),
    "data.image_column": _text(nonempty=True, what="a column name"),
    "data.max_samples": _optional(_int(1, 10**9)),
    "data.num_workers": _int(0, 256),
    "data.cache": _BOOL,
    "data.cache_dir": _optional(_text(what="a folder path")),
    "data.verify_images": _BOOL,
    "data.buckets": _BOOL,
    "data.bucket_step": _optional_size(_int(8, 8192, multiple=8)),
    "data.bucket_min": _optional_size(_int(8, 8192, multiple=8)),
    "data.bucket_max": _optional_size(_int(8, 16384, multiple=8)),
    "train.seed": _SEED,
    "train.max_steps": _int(1, 10**9),
    "train.micro_batch": _int(1, 65536),
    "train.grad_accum": _int(1, 65536),
    "train.mixed_precision": _choice("auto", "bf16", "fp16", "fp32"),
    "train.max_grad_norm": _float(0),
    "train.ema_decay": _float(0, 1, high_open=True),
    "train.ema_dtype": _choice("fp32", "bf16"),
    "train.min_snr_gamma": _float(0),
    "train.noise_offset": _float(0, 1),
    "train.caption_dropout": _float(0, 1, high_open=True),
    "train.log_every": _int(1, 10**9),
    "train.cudnn_benchmark": _BOOL,
    "train.tf32": _BOOL,
    "train.memory_saver": _BOOL,
    "train.oom_guard": _BOOL,
    "train.oom_fallback_checkpointing": _BOOL,
    "train.trace_collectives": _BOOL,
    "train.profile_steps": Rule(
        _profile_steps, "'' (off) or FIRST-LAST step numbers from 1 to 1,000,000,000, e.g. 11-13"
    ),
    "optim.name": _choice("adamw", "adamw8bit"),
    "optim.lr": _float(0, low_open=True),
    "optim.betas": _each(_float(0, 1, high_open=True), "two numbers in [0, 1), e.g. 0.9,0.999"),
    "optim.weight_decay": _float(0),
    "optim.eps": _float(0, 1, low_open=True),
    "optim.fused": _choice("auto", "true", "false"),
    "optim.state_dtype": _choice("fp32", "bf16"),
    "optim.master_weights": _BOOL,
    "optim.schedule": _choice("cosine", "constant"),
    "optim.warmup_steps": _STEPS,
    "optim.min_lr_ratio": _float(0, 1),
    "ddp.backend": _choice("auto", "nccl", "gloo"),
    "ddp.bucket_cap_mb": _float(0, 10240, low_open=True),
    "ddp.find_unused_parameters": _BOOL,
    "ddp.gradient_as_bucket_view": _BOOL,
    "ddp.static_graph": _BOOL,
    "ddp.timeout_s": _int(1, 10**7),
    "checkpoint.every": _STEPS,
    "checkpoint.keep": _int(0, 10**6),
    "checkpoint.resume": _text(what="'', 'latest' or a checkpoint folder"),
    "checkpoint.on_signal": _BOOL,
    "checkpoint.at_end": _BOOL,
    "checkpoint.reshard": _BOOL,
    "sample.every": _STEPS,
    "sample.at_end": _BOOL,
    "sample.prompts": _each(_text(), "a list of prompts without NUL characters"),
    "sample.images_per_prompt": _int(1, 64),
    "sample.steps": _int(1, 1000),
    "sample.guidance_scale": _float(0, 100),
    "sample.seed": _SEED,
    "output.name": Rule(
        lambda v: isinstance(v, str) and (v == "" or _RUN_NAME.fullmatch(v) is not None),
        "'' (the preset's name) or up to 100 letters, digits, '.', '_' or '-', not starting with '.' or '-'",
    ),
    "output.dir": _text(what="'' (./runs/NAME) or a folder path"),
    "output.export": _BOOL,
    "lora.rank": _int(0, 1024),
    "lora.alpha": _float(0, 1e6),
    "lora.target_modules": _layer_names("to_k;to_q;to_v;to_out.0"),
    "lora.dropout": _float(0, 1, high_open=True),
    "lora.export_merged": _BOOL,
    "lora.text_encoder": _BOOL,
    "lora.text_encoder_targets": _layer_names("q_proj;k_proj;v_proj;out_proj"),
    "lora.text_encoder_lr": _float(0, 1e6),
    "output.report_to": _choice("tensorboard", "wandb", "all", "none"),
    "output.progress": _choice("auto", "bar", "lines", "quiet"),
}


def leaf_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Dotted names of every leaf of the config tree (the keys --set takes)."""
    node = Config() if node is None else node
    keys = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(leaf_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def validate(cfg: Config) -> None:
    """Check every value against RULES: ConfigError names the key, the value and what is allowed."""
    for key, rule in RULES.items():
        value = get_key(cfg, key)
        if not rule.check(value):
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(f"config key {key!r} is {shown!r}; allowed: {rule.allowed}")
    for key, allowed in _conflicts(cfg):
        raise ConfigError(f"config key {key!r} is {get_key(cfg, key)!r}; allowed: {allowed}")


def _conflicts(cfg: Config) -> list[tuple[str, str]]:
    """Values that are valid alone but not together: (key, what is allowed given the other key)."""
    found = []
    if cfg.optim.name == "adamw8bit" and cfg.model.unet_dtype == "bf16":
        found.append(
            (
                "optim.name",
                "adamw (or model.unet_dtype=fp32/auto with adamw8bit): 8-bit AdamW keeps no fp32 master copy, "
                "so bf16 weights would round its small updates away",
            )
        )
    if cfg.lora.text_encoder and cfg.lora.rank == 0:
        found.append(("lora.text_encoder", "false unless lora.rank > 0 (the text encoder gets LoRA adapters only)"))
    if cfg.lora.text_encoder and cfg.lora.rank > 0 and cfg.train.ema_decay > 0:
        found.append(
            ("train.ema_decay", "0 with lora.text_encoder=true (the EMA averages the UNet's weights only)")
        )
    data = cfg.data
    if data.bucket_min and data.bucket_max and data.bucket_min > data.bucket_max:
        found.append(("data.bucket_min", f"at most data.bucket_max ({data.bucket_max})"))
    return found


def get_key(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what --print-config shows; loadable with --config)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:  # TOML has no null: leave the key out (it keeps its default, unset)
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
