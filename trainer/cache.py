"""Cached VAE latents and text embeddings: encoded once, sharded across ranks, reused across runs.

Training with frozen VAE and text encoder spends much of each step re-encoding the same images
and captions. `build_cache` encodes every image (unflipped, and flipped when random_flip is on)
and every distinct caption once, stores them on disk, and returns a `CachedDataset` whose items
replace pixels and captions in the training loop:

    {"latent_mean": [C, h, w], "latent_std": [C, h, w], "encoder_hidden_states": [L, D],
     "index": int, "caption": str}

The trainer samples `latents = (mean + std * noise) * vae.config.scaling_factor` each step
(`sample_latents`); the cache stores the distribution, never scaled latents, so it is reusable
whatever scaling factor a model declares.

Where: `<cache root>/<key>/` with the root `DataConfig.cache_dir`, else `$SDDOCTOR_CACHE_DIR`,
else `~/.cache/sddoctor/latents` (the root also holds `verified/`, trainer/data.py's memo of
image checks). The key hashes the data (file list with sizes, mtimes and
captions, or the digits arrays; resolution, crop, flip), the VAE, text encoder and tokenizer
(class, config, parameter names, shapes, dtypes and a strided sample of every tensor's values;
vocabulary) and the storage dtype. Any change gives a new key, so stale entries are never read;
delete the folder to reclaim space.

Layout of one entry, written once and never modified:

    manifest.json                       written last: its presence marks a complete cache
    images-00001-of-00004/index.npy     item indices of rank 1's share
                         source.npy     item whose image was encoded (differs if one failed)
                         mean.npy std.npy [mean_flip.npy std_flip.npy]
                         errors.json    images that failed to decode (substituted)
    captions-00001-of-00004/ids.npy hidden.npy

Each shard is written to a temporary folder and renamed into place, so a run killed mid-write
leaves no partial shard behind. Under torch.distributed every rank encodes 1/world_size of the
images and captions, all ranks meet at a barrier, then every rank maps all shards (read-only
memory maps, shared through the page cache). A rank that cannot see another rank's shard (cache
folder not shared between nodes) encodes it itself, so a cache on node-local disk still works.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.data import (
    CACHE_DIR_ENV,
    AugmentedDataset,
    DataConfig,
    DataError,
    SampleKey,
    SkippedFile,
    cache_root,
    collate,
    default_cache_root,
    flip_decision,
)
from trainer.vae_encode import FallbackEncoder

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

log = logging.getLogger("trainer.cache")

CACHE_FORMAT = 1
# Values sampled per tensor for the model fingerprint: enough to notice any retrained or
# swapped weights, cheap for SD-size models (hundreds of tensors, one device-to-host copy).
FINGERPRINT_SAMPLES = 256
# VAE config entries applied to latents after encoding (by the trainer), not part of the key.
LATENT_NORMALISATION_KEYS = frozenset(
    {"scaling_factor", "shift_factor", "latents_mean", "latents_std", "force_upcast"}
)


# --------------------------------------------------------------------------------------------
# Fingerprints


def module_fingerprint(module: torch.nn.Module) -> str:
    """Hash of a module's class, config, and parameter/buffer names, shapes, dtypes and values.

    Values are a strided sample of each tensor, gathered on the module's device and copied to
    the host once, so fingerprinting SD2's VAE and text encoder takes milliseconds on a GPU.
    """
    h = hashlib.sha256(type(module).__name__.encode())
    config = getattr(module, "config", None)
    if config is not None:
        as_dict = dict(config) if isinstance(config, dict) else getattr(config, "to_dict", lambda: {})()
        # Private keys ("_use_default_values" is a set dumped in hash-seed order, "_name_or_path"),
        # library versions and the latent normalisation the trainer applies after the cache do
        # not change what encode() returns.
        as_dict = {
            k: v
            for k, v in as_dict.items()
            if not k.startswith("_") and not k.endswith("_version") and k not in LATENT_NORMALISATION_KEYS
        }
        h.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    samples = []
    for name, tensor in module.state_dict().items():
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        count = min(flat.numel(), FINGERPRINT_SAMPLES)
        # Integer arithmetic: a float32 linspace rounds the last position past the end of
        # tensors with more than 2**24 elements.
        positions = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        samples.append(flat[positions].float())
    if samples:
        h.update(torch.cat(samples).cpu().numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(f"max_length={tokenizer.model_max_length}".encode())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items())).encode())
    probe = tokenizer(
        ["a photo of a cat, 123"],
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
    )
    h.update(json.dumps(list(map(list, probe["input_ids"]))).encode())
    return h.hexdigest()


def cache_key(
    dataset: AugmentedDataset,
    vae: torch.nn.Module,
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    dtype: torch.dtype,
) -> tuple[str, dict[str, str]]:
    """(key, parts): the folder name of this data+model combination and what went into it."""
    parts = {
        "format": str(CACHE_FORMAT),
        "data": dataset.fingerprint(),
        "vae": module_fingerprint(vae),
        "text_encoder": module_fingerprint(text_encoder),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "dtype": str(dtype),
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return key, parts


# --------------------------------------------------------------------------------------------
# Collectives (no-ops without torch.distributed)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _all_reduce_min(values: Sequence[int], device: torch.device) -> list[int]:
    if not _distributed():
        return list(values)
    dist = torch.distributed
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values), dtype=torch.int64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(v) for v in tensor.tolist()]


def _barrier(device: torch.device) -> None:
    # An all-reduce rather than dist.barrier(): NCCL's barrier has to guess the device.
    _all_reduce_min([0], device)


# --------------------------------------------------------------------------------------------
# Storage


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: store the bits
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # copy out of the memory map
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shard_name(kind: str, rank: int, world_size: int) -> str:
    return f"{kind}-{rank:05d}-of-{world_size:05d}"


class _ShardWriter:
    """Fill a shard in a temporary folder, row block by row block, then rename it into place.

    Arrays are `.npy` memory maps written as batches arrive, so a rank never holds its whole
    share in memory; the rename makes the shard appear complete or not at all.
    """

    def __init__(self, entry: Path, name: str, rows: int) -> None:
        self.final = entry / name
        self.tmp = entry / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self.rows = rows
        self.arrays: dict[str, np.memmap] = {}

    def write(
        self, name: str, offset: int, values: torch.Tensor | np.ndarray, rows: int | None = None
    ) -> None:
        """Rows [offset, offset + len(values)) of array `name` (of `rows` rows, default the shard's)."""
        block = _to_numpy(values) if isinstance(values, torch.Tensor) else values
        if name not in self.arrays:
            self.arrays[name] = np.lib.format.open_memmap(
                self.tmp / f"{name}.npy",
                mode="w+",
                dtype=block.dtype,
                shape=(self.rows if rows is None else rows, *block.shape[1:]),
            )
        self.arrays[name][offset : offset + len(block)] = block

    def commit(self, extra: dict[str, Any] | None = None) -> None:
        try:
            for array in self.arrays.values():
                array.flush()
            self.arrays.clear()
            if extra is not None:
                (self.tmp / "errors.json").write_text(json.dumps(extra))
            try:
                os.rename(self.tmp, self.final)
            except OSError:
                if not self.final.is_dir():  # another process finished the same shard first: keep theirs
                    raise
        finally:
            self.abort()

    def abort(self) -> None:
        self.arrays.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Encoding


class _EncodeView(Dataset):
    """Unflipped pixels of chosen items at their fixed (epoch-0) crop, for encoding."""

    def __init__(self, dataset: AugmentedDataset, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> dict[str, Any]:
        index = self.indices[position]
        pixels, used, error = self.dataset.pixels(index, epoch=0, flip=False)
        return {"pixel_values": pixels, "index": index, "source": used, "load_error": error}


def _model_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _precision(module: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """Run a full-precision module in `dtype` via autocast; a module already in low precision as is."""
    if dtype in (torch.float16, torch.bfloat16) and _model_dtype(module) == torch.float32:
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


@dataclass
class CacheStats:
    key: str
    path: str
    hit: bool  # True when this call encoded nothing
    encoded_images: int = 0  # by this rank
    encoded_captions: int = 0
    seconds: float = 0.0
    load_errors: list[str] = field(default_factory=list)


def _encode_images(
    writer: _ShardWriter,
    dataset: AugmentedDataset,
    indices: Sequence[int],
    vae: AutoencoderKL,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
    num_workers: int,
    with_flip: bool,
) -> list[str]:
    """Encode `indices` into `writer` (index, mean, std[, mean_flip, std_flip]); return load errors.

    Items of one size share arrays: one group without aspect-ratio buckets (`mean.npy`, ...), one
    per bucket with them (`mean.512x512.npy`, `index.512x512.npy`, ...).
    """
    groups: dict[str, list[int]] = {}
    for index in indices:
        suffix = "" if dataset.target_sizes is None else ".{}x{}".format(*dataset.target_size(index))
        groups.setdefault(suffix, []).append(index)
    errors: list[str] = []
    for suffix, members in groups.items():
        errors += _encode_group(
            writer, dataset, members, suffix, vae, device, dtype, batch_size, num_workers, with_flip
        )
    return errors


def _encode_group(
    writer: _ShardWriter,
    dataset: AugmentedDataset,
    indices: Sequence[int],
    suffix: str,
    vae: AutoencoderKL,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
    num_workers: int,
    with_flip: bool,
) -> list[str]:
    loader = DataLoader(
        _EncodeView(dataset, indices),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=collate,
        shuffle=False,
    )
    errors: list[str] = []
    in_dtype = _model_dtype(vae)
    encode = FallbackEncoder(vae)
    rows = len(indices)
    writer.write("index" + suffix, 0, np.asarray(list(indices), dtype=np.int64), rows)
    offset = 0
    for batch in loader:
        pixels = batch["pixel_values"].to(device=device, dtype=in_dtype, non_blocking=True)
        errors.extend(e for e in batch["load_error"] if e)
        if with_flip:  # flip after crop == crop of the flipped image at the mirrored offset
            pixels = torch.cat([pixels, pixels.flip(-1)])
        with torch.no_grad(), _precision(vae, device, dtype):
            mean, std = encode(pixels)
        mean, std = mean.to(dtype), std.to(dtype)
        n = len(batch["index"])
        writer.write("source" + suffix, offset, batch["source"].numpy(), rows)
        writer.write("mean" + suffix, offset, mean[:n], rows)
        writer.write("std" + suffix, offset, std[:n], rows)
        if with_flip:
            writer.write("mean_flip" + suffix, offset, mean[n:], rows)
            writer.write("std_flip" + suffix, offset, std[n:], rows)
        offset += n
    return errors


def _encode_captions(
    writer: _ShardWriter,
    captions: Sequence[str],
    ids: Sequence[int],
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
) -> None:
    """Encode captions[ids] into `writer` (ids, hidden = the encoder's last hidden state)."""
    writer.write("ids", 0, np.asarray(list(ids), dtype=np.int64))
    for start in range(0, len(ids), batch_size):
        batch = [captions[i] for i in ids[start : start + batch_size]]
        tokens = tokenizer(
            batch,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        with torch.no_grad(), _precision(text_encoder, device, dtype):
            hidden = text_encoder(tokens.input_ids.to(device))[0]
        writer.write("hidden", start, hidden.to(dtype))


# --------------------------------------------------------------------------------------------
# The cached dataset


class CachedDataset(Dataset):
    """Items from a complete cache entry; flips chosen from (seed, epoch, index) like the images.

    Index with an int (epoch from `set_epoch`) or a `SampleKey(index, epoch)`. Arrays are memory
    mapped lazily in each process, so the dataset pickles small for DataLoader workers.
    """

    def __init__(self, path: Path, dataset: AugmentedDataset, stats: CacheStats) -> None:
        self.path = path
        self.stats = stats
        self.seed = dataset.seed
        self.random_flip = dataset.cfg.random_flip
        self.epoch = 0
        self.manifest = json.loads((path / "manifest.json").read_text())
        self.dtype = getattr(torch, self.manifest["dtype"])
        self.captions_list = dataset.captions()
        table = {caption: i for i, caption in enumerate(self.manifest["captions"])}
        self.caption_ids = np.asarray([table[c] for c in self.captions_list], dtype=np.int64)
        # Item whose image (and so caption) stands in for each index; differs only where an
        # image failed to decode while the cache was built.
        self.source = np.arange(len(self.captions_list), dtype=np.int64)
        self.skipped = list(dataset.skipped) + [
            SkippedFile(p, "failed to decode; substituted") for p in stats.load_errors
        ]
        self._pid: int | None = None
        self._images: list[dict[str, np.ndarray]] = []
        self._texts: list[dict[str, np.ndarray]] = []
        self._image_loc = np.zeros((0, 2), dtype=np.int64)
        self._text_loc = np.zeros((0, 2), dtype=np.int64)
        self._open()  # fail now, not in a worker, if a shard is unreadable

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pid=None, _images=[], _texts=[])
        return state

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        n_items, n_captions = self.manifest["num_items"], len(self.manifest["captions"])
        image_loc = np.full((n_items, 2), -1, dtype=np.int64)
        text_loc = np.full((n_captions, 2), -1, dtype=np.int64)
        images: list[dict[str, np.ndarray]] = []
        texts: list[dict[str, np.ndarray]] = []
        for name in self.manifest["image_shards"]:
            for arrays in _groups(self.path / name):
                image_loc[arrays["index"], 0] = len(images)
                image_loc[arrays["index"], 1] = np.arange(len(arrays["index"]))
                if "source" in arrays:
                    self.source[arrays["index"]] = arrays["source"]
                images.append(arrays)
        for shard, name in enumerate(self.manifest["caption_shards"]):
            arrays = {p.stem: np.load(p, mmap_mode="r") for p in (self.path / name).glob("*.npy")}
            text_loc[arrays["ids"], 0] = shard
            text_loc[arrays["ids"], 1] = np.arange(len(arrays["ids"]))
            texts.append(arrays)
        if (image_loc[:, 0] < 0).any() or (text_loc[:, 0] < 0).any():
            raise DataError(
                f"cache {self.path} is incomplete; delete that folder and run again to rebuild it"
            )
        self._images, self._texts, self._image_loc, self._text_loc = images, texts, image_loc, text_loc
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.caption_ids)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, key: int | SampleKey) -> dict[str, Any]:
        if isinstance(key, (tuple, list)):
            index, epoch = int(key[0]), int(key[1])
        else:
            index, epoch = int(key), self.epoch
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        self._open()
        group, row = self._image_loc[index]
        arrays = self._images[group]
        flipped = self.random_flip and flip_decision(self.seed, epoch, index)
        suffix = "_flip" if flipped else ""
        source = int(self.source[index])
        caption_id = self.caption_ids[source]
        text_shard, text_row = self._text_loc[caption_id]
        return {
            "latent_mean": _from_numpy(arrays["mean" + suffix][row], self.dtype),
            "latent_std": _from_numpy(arrays["std" + suffix][row], self.dtype),
            "encoder_hidden_states": _from_numpy(self._texts[text_shard]["hidden"][text_row], self.dtype),
            "index": index,
            "caption": self.captions_list[source],
        }


def _groups(shard: Path) -> list[dict[str, np.ndarray]]:
    """The arrays of a shard by group (one per bucket size, or one), keyed without the group's suffix."""
    groups: dict[str, dict[str, np.ndarray]] = {}
    for path in shard.glob("*.npy"):
        name, _, size = path.stem.partition(".")
        groups.setdefault(size, {})[name] = np.load(path, mmap_mode="r")
    return [groups[size] for size in sorted(groups)]


def sample_latents(
    mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw latents from the cached distribution (unscaled: multiply by vae.config.scaling_factor)."""
    noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + std * noise


# --------------------------------------------------------------------------------------------
# Building


def _write_problem(entry: Path) -> str:
    """Why shards cannot be written under `entry` ("" when they can)."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        probe = entry / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def _complete(entry: Path) -> bool:
    manifest = entry / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
        return data.get("format") == CACHE_FORMAT and all(
            (entry / name).is_dir() for name in data["image_shards"] + data["caption_shards"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class _Encoding:
    """What encoding a cache entry's shards takes: the models, and where and how they run."""

    vae: AutoencoderKL
    text_encoder: torch.nn.Module
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    batch_size: int
    num_workers: int


def build_cache(
    dataset: AugmentedDataset,
    vae: AutoencoderKL,
    text_encoder: torch.nn.Module,
    tokenizer: Any,
    cfg: DataConfig,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 16,
) -> CachedDataset:
    """Load the cache entry for this data and these models, encoding what is missing first.

    Call it on every rank at the same point (it runs collectives when torch.distributed is
    initialised). `vae` and `text_encoder` must already sit on `device`. Returns a dataset of
    all items on every rank; `result.stats` says whether it was a hit and what this rank encoded.
    """
    start = time.monotonic()
    device = torch.device(device)
    key, parts = cache_key(dataset, vae, text_encoder, tokenizer, dtype)
    entry = cache_root(cfg) / key
    hit = _agreed_hit(entry, key, device)
    captions = sorted(set(dataset.captions()))
    stats = CacheStats(key=key, path=str(entry), hit=hit)
    if not hit:
        encoding = _Encoding(vae, text_encoder, tokenizer, device, dtype, batch_size, cfg.num_workers)
        entry.mkdir(parents=True, exist_ok=True)
        _encode_missing_shards(entry, dataset, captions, encoding, rank, world_size, stats)
        if not (entry / "manifest.json").is_file():
            _write_manifest(entry, key, parts, dataset, captions, encoding, world_size)
    stats.load_errors.extend(_recorded_load_errors(entry))
    stats.seconds = time.monotonic() - start
    if rank == 0:
        if stats.hit:
            log.info("using cached latents and text embeddings from %s", entry)
        else:
            log.info("cache written to %s in %.1f s", entry, stats.seconds)
    return CachedDataset(entry, dataset, stats)


def _agreed_hit(entry: Path, key: str, device: torch.device) -> bool:
    """Whether every rank finds the entry complete; DataError when the ranks' keys differ, or when
    it must be written and some rank cannot write it.

    Every rank must take the same branch (the miss path has barriers), so hit, writability and
    the key are agreed on first. The key check catches ranks that see different data or
    weights, which would otherwise mix incompatible shards.
    """
    hit_here = _complete(entry)
    write_problem = "" if hit_here else _write_problem(entry)
    key_int = int(key[:15], 16)
    hit_all, key_min, neg_key_max, writable_all = _all_reduce_min(
        [int(hit_here), key_int, -key_int, int(not write_problem)], device
    )
    if key_min != -neg_key_max:
        raise DataError(
            "ranks disagree on the data or model fingerprint (different files, captions or weights on "
            "different nodes); give every rank the same data folder and model"
        )
    if not hit_all and not writable_all:
        where = f"{entry.parent}: {write_problem}" if write_problem else f"{entry.parent} on another rank"
        raise DataError(
            f"cannot write the latent cache at {where}; set data.cache_dir (or {CACHE_DIR_ENV}) to a "
            "writable folder, or turn the cache off with --set data.cache=false"
        )
    return bool(hit_all)


def _encode_missing_shards(
    entry: Path,
    dataset: AugmentedDataset,
    captions: list[str],
    encoding: _Encoding,
    rank: int,
    world_size: int,
    stats: CacheStats,
) -> None:
    """This rank's shard, then, after all ranks have written theirs, any shard it cannot see."""
    if rank == 0:
        log.info(
            "encoding %d images%s and %d captions into %s (%d ranks)",
            len(dataset),
            " (and their flips)" if dataset.cfg.random_flip else "",
            len(captions),
            entry,
            world_size,
        )
    _encode_shard(entry, rank, world_size, dataset, captions, encoding, stats)
    _barrier(encoding.device)
    for r in range(world_size):  # shards this rank cannot see: cache folder not shared
        if r != rank and not (
            (entry / _shard_name("images", r, world_size)).is_dir()
            and (entry / _shard_name("captions", r, world_size)).is_dir()
        ):
            log.warning("rank %d cannot see cache shard %d in %s; encoding it locally", rank, r, entry)
            _encode_shard(entry, r, world_size, dataset, captions, encoding, stats)


def _encode_shard(
    entry: Path,
    shard: int,
    world_size: int,
    dataset: AugmentedDataset,
    captions: list[str],
    encoding: _Encoding,
    stats: CacheStats,
) -> None:
    """Encode the images and the captions of shard `shard` (items shard, shard + world_size, ...),
    each unless its folder is already there."""
    image_shard = _shard_name("images", shard, world_size)
    if not (entry / image_shard).is_dir():
        indices = range(shard, len(dataset), world_size)
        writer = _ShardWriter(entry, image_shard, len(indices))
        try:
            errors = _encode_images(
                writer,
                dataset,
                indices,
                encoding.vae,
                encoding.device,
                encoding.dtype,
                encoding.batch_size,
                encoding.num_workers,
                dataset.cfg.random_flip,
            )
            writer.commit({"load_errors": errors})
        finally:
            writer.abort()
        stats.encoded_images += len(indices)
    caption_shard = _shard_name("captions", shard, world_size)
    if not (entry / caption_shard).is_dir():
        ids = list(range(shard, len(captions), world_size))
        writer = _ShardWriter(entry, caption_shard, len(ids))
        try:
            _encode_captions(
                writer,
                captions,
                ids,
                encoding.text_encoder,
                encoding.tokenizer,
                encoding.device,
                encoding.dtype,
                encoding.batch_size,
            )
            writer.commit()
        finally:
            writer.abort()
        stats.encoded_captions += len(ids)


def _write_manifest(
    entry: Path,
    key: str,
    parts: dict[str, str],
    dataset: AugmentedDataset,
    captions: list[str],
    encoding: _Encoding,
    world_size: int,
) -> None:
    """manifest.json, written last: its presence (with every shard) marks the entry complete."""
    image_shards = [_shard_name("images", r, world_size) for r in range(world_size)]
    sample = np.load(sorted((entry / image_shards[0]).glob("mean.*npy"))[0], mmap_mode="r")
    manifest = {
        "format": CACHE_FORMAT,
        "key": key,
        "parts": parts,
        "source": dataset.cfg.source,
        "data": asdict(dataset.cfg),
        "seed": dataset.seed,
        "num_items": len(dataset),
        "captions": captions,
        "image_shards": image_shards,
        "caption_shards": [_shard_name("captions", r, world_size) for r in range(world_size)],
        "latent_shape": list(sample.shape[1:]),
        "dtype": _dtype_name(encoding.dtype),
        "flips": dataset.cfg.random_flip,
        "vae": type(encoding.vae).__name__,
        "text_encoder": type(encoding.text_encoder).__name__,
        "created": time.time(),
        "torch": torch.__version__,
    }
    _write_json_atomic(entry / "manifest.json", manifest)


def _recorded_load_errors(entry: Path) -> list[str]:
    """The images that failed to load while the entry's image shards were encoded, by any rank."""
    manifest = json.loads((entry / "manifest.json").read_text())
    errors: list[str] = []
    for name in manifest["image_shards"]:
        errors_file = entry / name / "errors.json"
        if errors_file.is_file():
            errors.extend(json.loads(errors_file.read_text()).get("load_errors", []))
    return errors


__all__ = [
    "CACHE_DIR_ENV",
    "CacheStats",
    "CachedDataset",
    "build_cache",
    "cache_key",
    "cache_root",
    "default_cache_root",
    "module_fingerprint",
    "sample_latents",
    "tokenizer_fingerprint",
]
