"""Training data: image folders and the built-in digits set, augmentation, resumable DDP sampling.

Three sources, chosen by `DataConfig.source`:

* `"digits"`: scikit-learn's handwritten digits (shipped inside the package, no download),
  upscaled to the training resolution, 3-channel, captioned like "a handwritten digit seven".
* a folder in the Hugging Face `imagefolder` convention: one or more `metadata.jsonl` (or
  `metadata.csv`) files whose rows name an image (`file_name`, relative to the metadata file)
  and its caption (`text`). Metadata files in sub-folders are honoured.
* a folder of images with same-named `.txt` caption files (`cat.png` + `cat.txt`), nested
  folders included.

Augmentation (random crop, random flip) is a pure function of `(seed, epoch, index)`, never of
a worker's RNG state, so a run and its resumed copy see identical pixels whatever the number of
DataLoader workers. The epoch reaches the workers inside the sample key that
`ResumableDistributedSampler` yields (`SampleKey(index, epoch)`), which also works with
persistent workers, whose copy of the dataset never sees `set_epoch` calls in the main process.

Corrupt images never stop a run. Folder datasets open and verify every image when they index
the folder (cheap: no pixel decode for most formats) and leave out the ones that fail, with a
warning naming each file; since every rank indexes the same files, all ranks agree on the
dataset length and batch sizes stay equal across ranks. An image that passes verification but
fails to decode later is replaced by the next readable index (deterministically) and reported in
the item's `load_error` field and in `dataset.skipped` (of the process that loaded it).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger("trainer.data")

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")
# Named warnings per dataset build; the rest are counted in the summary line.
MAX_NAMED_WARNINGS = 20

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# The first template is the canonical prompt used for sample grids; the others add variety.
# The template is chosen by index, not at random, so each item's caption is fixed (and its text
# embedding can be cached).
DIGIT_CAPTION_TEMPLATES = (
    "a handwritten digit {word}",
    "a handwritten digit {word}",
    "the digit {word}, written by hand",
)


CACHE_DIR_ENV = "SDDOCTOR_CACHE_DIR"


def default_cache_root() -> Path:
    """$SDDOCTOR_CACHE_DIR, else $XDG_CACHE_HOME/sddoctor/latents, else ~/.cache/sddoctor/latents."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "sddoctor" / "latents"


def cache_root(cfg: DataConfig) -> Path:
    """Folder holding latent caches (one sub-folder per key) and the image verification memo."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_root()


class DataError(Exception):
    """Bad data input (missing or empty folder, malformed metadata). The message says the fix."""


@dataclass
class DataConfig:
    """Where the training images come from and how they are prepared."""

    source: str = "digits"  # "digits" or a folder path
    resolution: int = 32
    center_crop: bool = True  # False: random crop (per epoch; fixed per image when cached)
    random_flip: bool = False  # horizontal flip with probability 1/2
    caption_column: str = "text"  # imagefolder metadata column holding the caption
    image_column: str = "file_name"  # imagefolder metadata column holding the image path
    max_samples: int | None = None  # keep only the first N items (sorted order)
    num_workers: int = 2  # DataLoader worker processes per rank
    cache: bool = False  # precompute VAE latents and text embeddings (trainer/cache.py)
    cache_dir: str | None = None  # default: $SDDOCTOR_CACHE_DIR or ~/.cache/sddoctor/latents
    verify_images: bool = True  # open and verify every image while indexing the folder
    # Aspect-ratio buckets (trainer/buckets.py): each image is resized to the bucket of about
    # resolution^2 pixels nearest its aspect ratio instead of a centre square; a batch holds one bucket.
    buckets: bool = False
    bucket_step: int = 0  # bucket sides are multiples of this; 0: the smallest the model allows
    bucket_min: int = 0  # shortest bucket side; 0: resolution / 2
    bucket_max: int = 0  # longest bucket side; 0: resolution * 2


class SampleKey(NamedTuple):
    """What the sampler hands the dataset: which item, and for which epoch's augmentation."""

    # Hides tuple.index on purpose: `key.index` is how callers read it (mypy flags any field that
    # shares a tuple method's name).
    index: int  # type: ignore[assignment]
    epoch: int


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Record:
    path: Path
    caption: str


# --------------------------------------------------------------------------------------------
# Deterministic augmentation


def _rng(seed: int, epoch: int, index: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch, index, stream])


def flip_decision(seed: int, epoch: int, index: int) -> bool:
    """Whether item `index` is flipped in `epoch`; shared by image and cached datasets."""
    return bool(_rng(seed, epoch, index, 1).random() < 0.5)


def crop_offsets(
    seed: int, epoch: int, index: int, size: tuple[int, int], resolution: int | tuple[int, int]
) -> tuple[int, int]:
    """Random crop origin (left, top) of a `resolution` square (or (w, h) bucket) in an image of
    `size` (w, h) already resized."""
    w, h = size
    tw, th = (resolution, resolution) if isinstance(resolution, int) else resolution
    rng = _rng(seed, epoch, index, 0)
    return int(rng.integers(0, w - tw + 1)), int(rng.integers(0, h - th + 1))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float tensor [3, H, W] in [-1, 1]."""
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def _key(key: int | SampleKey | tuple[int, int] | list[int], default_epoch: int) -> tuple[int, int]:
    if isinstance(key, (tuple, list)):
        return int(key[0]), int(key[1])
    return int(key), default_epoch


class AugmentedDataset(Dataset):
    """Base: resize, crop and flip images deterministically from (seed, epoch, index).

    Items are `{"pixel_values": FloatTensor[3, R, R] in [-1, 1], "caption": str, "index": int,
    "load_error": str}`; `load_error` is "" unless the requested image failed to decode and
    another one was substituted (then it names the failed file). Index with an int (epoch taken
    from `set_epoch`, 0 by default) or a `SampleKey(index, epoch)`.
    """

    kind = "base"

    def __init__(self, cfg: DataConfig, seed: int = 0, verbose: bool = True) -> None:
        self.cfg = cfg
        self.seed = seed
        self.verbose = verbose
        self.epoch = 0
        self.skipped: list[SkippedFile] = []
        self._failed_indices: set[int] = set()
        self._named_warnings = 0
        #: (w, h) each item is cropped to: its aspect-ratio bucket (trainer/buckets.py); None: squares
        self.target_sizes: list[tuple[int, int]] | None = None

    # subclasses provide these
    def __len__(self) -> int:
        raise NotImplementedError

    def caption(self, index: int) -> str:
        raise NotImplementedError

    def describe_item(self, index: int) -> str:
        raise NotImplementedError

    def load_image(self, index: int) -> Image.Image:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Hash of everything that determines the items (for cache keys)."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Epoch used when indexed with a plain int (the sampler's keys carry their own)."""
        self.epoch = epoch

    def set_target_sizes(self, sizes: list[tuple[int, int]]) -> None:
        """Crop item i to sizes[i] (w, h) instead of the resolution square (aspect-ratio buckets)."""
        if len(sizes) != len(self):
            raise ValueError(f"{len(sizes)} target sizes for {len(self)} items")
        self.target_sizes = list(sizes)

    def _buckets_tag(self) -> bytes:
        """The items' bucket sizes for the fingerprint (nothing without buckets: earlier keys hold)."""
        return b"" if self.target_sizes is None else json.dumps(self.target_sizes).encode()

    def target_size(self, index: int) -> tuple[int, int]:
        res = self.cfg.resolution
        return self.target_sizes[index] if self.target_sizes is not None else (res, res)

    def captions(self) -> list[str]:
        return [self.caption(i) for i in range(len(self))]

    def transform(self, image: Image.Image, index: int, epoch: int, flip: bool | None = None) -> torch.Tensor:
        """Resize to cover the item's target (R x R, or its bucket), crop to it, flip; `flip=None`
        draws the flip from the seed."""
        tw, th = self.target_size(index)
        image = image.convert("RGB")
        w, h = image.size
        scale = max(tw / w, th / h)
        new_size = (max(tw, round(w * scale)), max(th, round(h * scale)))
        if new_size != (w, h):
            image = image.resize(new_size, Image.Resampling.BILINEAR)
        w, h = new_size
        if self.cfg.center_crop:
            left, top = (w - tw) // 2, (h - th) // 2
        else:
            left, top = crop_offsets(self.seed, epoch, index, (w, h), (tw, th))
        if (w, h) != (tw, th):
            image = image.crop((left, top, left + tw, top + th))
        pixels = to_tensor(image)
        if flip is None:
            flip = self.cfg.random_flip and flip_decision(self.seed, epoch, index)
        if flip:
            pixels = pixels.flip(-1)
        return pixels

    def pixels(self, index: int, epoch: int, flip: bool | None = None) -> tuple[torch.Tensor, int, str]:
        """Pixels of `index`, or of the next readable item if it fails: (pixels, used index, error)."""
        n = len(self)
        error = ""
        for step in range(n):
            candidate = (index + step) % n
            if candidate in self._failed_indices:  # known bad: still reported on every use
                error = error or self.describe_item(candidate)
                continue
            try:
                image = self.load_image(candidate)
            except Exception as exc:  # any decoder failure: PIL raises many kinds
                self._failed_indices.add(candidate)
                self._skip(self.describe_item(candidate), f"failed to decode: {exc}")
                error = error or self.describe_item(candidate)
                continue
            # Crop/flip follow the requested index so a substitution does not shift randomness.
            return self.transform(image, index, epoch, flip), candidate, error
        raise DataError(f"no image in {self.cfg.source} could be read; check the files")

    def __getitem__(self, key: int | SampleKey) -> dict[str, Any]:
        index, epoch = _key(key, self.epoch)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        pixels, used, error = self.pixels(index, epoch)
        return {"pixel_values": pixels, "caption": self.caption(used), "index": index, "load_error": error}

    def _skip(self, path: str, reason: str) -> None:
        self.skipped.append(SkippedFile(path, reason))
        if not self.verbose:
            return
        if self._named_warnings < MAX_NAMED_WARNINGS:
            log.warning("skipping %s: %s", path, reason)
        elif self._named_warnings == MAX_NAMED_WARNINGS:
            log.warning("more unreadable files: not naming each one (see dataset.skipped)")
        self._named_warnings += 1


# --------------------------------------------------------------------------------------------
# Built-in digits


class DigitsDataset(AugmentedDataset):
    """scikit-learn's 1,797 8x8 handwritten digits, dark ink on white, upscaled to R x R."""

    kind = "digits"

    def __init__(self, cfg: DataConfig, seed: int = 0, verbose: bool = True) -> None:
        super().__init__(cfg, seed, verbose)
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.asarray(digits.images, dtype=np.float32)  # values 0..16, 16 = full ink
        self.images = (255.0 - images * (255.0 / 16.0)).round().astype(np.uint8)
        self.labels = np.asarray(digits.target, dtype=np.int64)
        if cfg.max_samples is not None:
            self.images = self.images[: cfg.max_samples]
            self.labels = self.labels[: cfg.max_samples]

    def __len__(self) -> int:
        return len(self.labels)

    def caption(self, index: int) -> str:
        template = DIGIT_CAPTION_TEMPLATES[index % len(DIGIT_CAPTION_TEMPLATES)]
        return template.format(word=DIGIT_WORDS[int(self.labels[index])])

    def describe_item(self, index: int) -> str:
        return f"digits[{index}]"

    def load_image(self, index: int) -> Image.Image:
        # Bicubic straight to the target size: smoother strokes than the generic bilinear path.
        res = self.cfg.resolution
        return Image.fromarray(self.images[index]).resize((res, res), Image.Resampling.BICUBIC)

    def fingerprint(self) -> str:
        import sklearn

        h = hashlib.sha256()
        h.update(f"digits|sklearn={sklearn.__version__}|{DIGIT_CAPTION_TEMPLATES}".encode())
        h.update(self.images.tobytes())
        h.update(self.labels.tobytes())
        h.update(_transform_tag(self.cfg, self.seed).encode())
        h.update(self._buckets_tag())
        return h.hexdigest()


def prompt_for_digit(digit: int) -> str:
    """The canonical caption of a digit, for sample grids: 'a handwritten digit seven'."""
    return DIGIT_CAPTION_TEMPLATES[0].format(word=DIGIT_WORDS[digit])


# --------------------------------------------------------------------------------------------
# Image folders


class FolderDataset(AugmentedDataset):
    """Images listed by imagefolder metadata or paired with `.txt` captions under `root`."""

    def __init__(
        self,
        cfg: DataConfig,
        records: list[Record],
        kind: str,
        root: Path,
        skipped: list[SkippedFile],
        seed: int = 0,
        verbose: bool = True,
    ) -> None:
        super().__init__(cfg, seed, verbose)
        self.kind = kind
        self.root = root
        self.records = records
        self.skipped = list(skipped)
        self._stats = [(r.path.stat().st_size, r.path.stat().st_mtime_ns) for r in records]

    def __len__(self) -> int:
        return len(self.records)

    def caption(self, index: int) -> str:
        return self.records[index].caption

    def describe_item(self, index: int) -> str:
        return str(self.records[index].path)

    def load_image(self, index: int) -> Image.Image:
        with Image.open(self.records[index].path) as image:
            image.load()
            if image.width < 1 or image.height < 1:
                raise ValueError("image has no pixels")
            return image.convert("RGB")

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        # Relative paths: a moved or copied folder (same files, sizes, mtimes) keeps its cache.
        h.update(f"{self.kind}|{_transform_tag(self.cfg, self.seed)}".encode())
        for record, (size, mtime) in zip(self.records, self._stats, strict=True):
            rel = os.path.relpath(record.path, self.root)
            h.update(json.dumps([rel, size, mtime, record.caption]).encode())
        h.update(self._buckets_tag())
        return h.hexdigest()


def _transform_tag(cfg: DataConfig, seed: int) -> str:
    # Seed matters only for random crops (flips are cached both ways).
    crop = "center" if cfg.center_crop else f"random-seed{seed}"
    return f"res={cfg.resolution}|crop={crop}|flip={cfg.random_flip}|max={cfg.max_samples}"


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file()


class _Containment:
    """Whether paths resolve (symbolic links followed) inside the data folder.

    Folder real paths are cached, so a file costs one lstat unless it is itself a link.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self._folders: dict[str, str] = {}

    def real(self, path: Path) -> str:
        if os.path.islink(path):
            return os.path.realpath(path)
        parent = str(path.parent)
        if parent not in self._folders:
            self._folders[parent] = os.path.realpath(parent)
        return os.path.join(self._folders[parent], path.name)

    def escape(self, path: Path) -> str | None:
        """None when `path` stays inside the folder, else the outside place it leads to."""
        real = self.real(path)
        inside = real == self.real_root or real.startswith(self.real_root.rstrip(os.sep) + os.sep)
        return None if inside else real

    def refuse(self, path: Path, target: str) -> DataError:
        return DataError(
            f"{path} leads to {target}, outside the data folder {self.root} (a symbolic link); the trainer "
            "reads only files inside data.source: copy the file into the folder, or point data.source at a "
            "folder that holds it"
        )


def _walk(root: Path, containment: _Containment) -> list[Path]:
    """All files under root, sorted, skipping hidden files and folders; DataError on a link out of root."""
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()  # (device, inode) of folders walked: symlink loops end
    stack = [root]
    while stack:
        folder = stack.pop()
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                path = Path(entry.path)
                if entry.is_symlink() and (target := containment.escape(path)) is not None:
                    raise containment.refuse(path, target)
                if entry.is_dir():
                    stack.append(path)
                else:  # files, and broken links (reported later as unreadable images)
                    found.append(path)
    return sorted(found)


def _metadata_image(meta: Path, lineno: int, value: Any, column: str, containment: _Containment) -> Path:
    """The image a metadata row names: a relative path that stays inside the data folder."""
    where = f"{meta}:{lineno}"
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise DataError(
            f"{where}: {column} must be a non-empty string, the image path relative to {meta.parent}; got {value!r}"
        )
    relative = Path(value)
    if relative.is_absolute() or PureWindowsPath(value).anchor:
        raise DataError(
            f"{where}: {column} {value!r} is an absolute path; give the path relative to {meta.parent} "
            "(images must lie inside the data folder)"
        )
    if ".." in relative.parts:
        raise DataError(
            f"{where}: {column} {value!r} contains '..'; images must lie inside the data folder: give a path "
            f"below {meta.parent}"
        )
    path = meta.parent / relative
    target = containment.escape(path)
    if target is not None:
        raise containment.refuse(path, target)
    return path


def _metadata_caption(meta: Path, lineno: int, value: Any, column: str) -> str:
    """A caption is a string, or a non-empty list of strings (the first is used)."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = value[0]
    if not isinstance(value, str):
        raise DataError(
            f"{meta}:{lineno}: {column} must be a string (or a list of strings, of which the first is used); "
            f'got {value!r}; write "" for an image without a caption'
        )
    return value


def _read_metadata(
    path: Path, image_column: str, caption_column: str, containment: _Containment
) -> list[Record]:
    rows: list[tuple[int, dict[str, Any]]] = []
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: not valid JSON ({exc.msg}); fix or remove that line"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}"
                    )
                rows.append((lineno, row))
    else:
        with path.open(encoding="utf-8-sig", newline="") as f:
            rows = [(lineno, row) for lineno, row in enumerate(csv.DictReader(f), 2)]
    records = []
    for lineno, row in rows:
        for column, option in ((image_column, "image_column"), (caption_column, "caption_column")):
            if column not in row:
                present = ", ".join(sorted(map(str, row))) or "none"
                raise DataError(
                    f"{path}:{lineno}: no column {column!r} (columns present: {present}); add it to every row "
                    f"or choose another column with --set data.{option}=NAME"
                )
        image = _metadata_image(path, lineno, row[image_column], image_column, containment)
        records.append(Record(image, _metadata_caption(path, lineno, row[caption_column], caption_column)))
    return records


def _verify_image(path: Path) -> str | None:
    """None if `path` opens as an image, else why not. Decodes no pixels for most formats."""
    try:
        with Image.open(path) as image:
            image.verify()
            if image.width < 1 or image.height < 1:
                return "image has no pixels"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return None


def _verify_records(cfg: DataConfig, root: Path, records: list[Record]) -> list[str | None]:
    """Verify each record's image, skipping files a previous run verified unchanged.

    The memo (`<cache root>/verified/<hash of the folder>.json`) maps each path to its size,
    mtime and verdict; an unwritable cache folder only costs the re-verification.
    """
    memo_path = (
        cache_root(cfg)
        / "verified"
        / (hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24] + ".json")
    )
    try:
        memo: dict[str, list] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    stats = [(r.path.stat().st_size, r.path.stat().st_mtime_ns) for r in records]
    problems: list[str | None] = [None] * len(records)
    todo = []
    for i, (record, (size, mtime)) in enumerate(zip(records, stats, strict=True)):
        known = memo.get(str(record.path))
        if isinstance(known, list) and len(known) == 3 and known[:2] == [size, mtime]:
            problems[i] = known[2]
        else:
            todo.append(i)
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) + 2)) as pool:
            for i, problem in zip(
                todo, pool.map(_verify_image, (records[i].path for i in todo)), strict=True
            ):
                problems[i] = problem
                memo[str(records[i].path)] = [*stats[i], problem]
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)
        except OSError as exc:
            log.debug("could not save image verification memo %s: %s", memo_path, exc)
    return problems


def index_folder(cfg: DataConfig) -> tuple[list[Record], str, list[SkippedFile]]:
    """(records, kind, skipped) for a folder; raises DataError when it cannot be used."""
    root = Path(cfg.source).expanduser()
    if not root.exists():
        raise DataError(
            f"data folder {root} does not exist; pass an existing folder with --set data.source=PATH "
            f"or use the built-in set with --set data.source=digits"
        )
    if not root.is_dir():
        raise DataError(
            f"data source {root} is not a folder; point data.source at the folder that holds the images"
        )
    containment = _Containment(root)
    files = _walk(root, containment)
    metadata = [p for p in files if p.name in METADATA_NAMES]
    skipped: list[SkippedFile] = []
    if metadata:
        kind = "imagefolder"
        records = []
        for meta in metadata:
            records.extend(_read_metadata(meta, cfg.image_column, cfg.caption_column, containment))
        if not records:
            raise DataError(
                f"{', '.join(map(str, metadata))} list no images; add one row per image like "
                f'{{"{cfg.image_column}": "0001.png", "{cfg.caption_column}": "a caption"}}'
            )
        present = []
        for record in records:
            if record.path.is_file():
                present.append(record)
            else:
                skipped.append(SkippedFile(str(record.path), "listed in metadata but missing"))
        records = present
    else:
        kind = "captions"
        images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
        if not images:
            raise DataError(
                f"no images found in {root} (looked for {', '.join(sorted(IMAGE_EXTENSIONS))}); add images with "
                "same-named .txt captions, or a metadata.jsonl with file_name and text columns"
            )
        records = []
        for image in images:
            txt = image.with_suffix(".txt")
            if txt.is_file():
                records.append(Record(image, txt.read_text(encoding="utf-8-sig", errors="replace").strip()))
            else:
                skipped.append(SkippedFile(str(image), f"no caption file {txt.name}"))
        if not records:
            raise DataError(
                f"none of the {len(images)} images in {root} has a caption: add a same-named .txt file next to "
                "each image (cat.png + cat.txt), or a metadata.jsonl with file_name and text columns"
            )
    records.sort(key=lambda r: str(r.path))
    if cfg.max_samples is not None:
        records = records[: cfg.max_samples]
    if cfg.verify_images and records:
        problems = _verify_records(cfg, root, records)
        kept = []
        for record, problem in zip(records, problems, strict=True):
            if problem is None:
                kept.append(record)
            else:
                skipped.append(SkippedFile(str(record.path), f"unreadable image ({problem})"))
        records = kept
    if not records:
        raise DataError(
            f"no readable images left in {root} after skipping {len(skipped)} files; see the warnings above"
        )
    return records, kind, skipped


def build_dataset(cfg: DataConfig, seed: int = 0, verbose: bool = True) -> AugmentedDataset:
    """The dataset `cfg.source` names. Raises DataError on unusable input.

    `seed` drives random crops and flips (with the epoch and index). `verbose=False` silences
    the per-file skip warnings (pass `verbose=(rank == 0)` under DDP: every rank indexes the same
    files). Skipped files are in `dataset.skipped` either way.
    """
    if cfg.resolution < 8:
        raise DataError(
            f"data.resolution={cfg.resolution} is too small; use 8 or more (e.g. 32 for tiny, 512 for SD)"
        )
    if cfg.max_samples is not None and cfg.max_samples < 1:
        raise DataError(f"data.max_samples={cfg.max_samples} must be 1 or more (or unset for all)")
    if cfg.source == "digits":
        return DigitsDataset(cfg, seed, verbose)
    records, kind, skipped = index_folder(cfg)
    dataset = FolderDataset(cfg, records, kind, Path(cfg.source).expanduser(), [], seed, verbose)
    for item in skipped:
        dataset._skip(item.path, item.reason)
    if skipped and verbose:
        log.warning(
            "skipped %d of %d images in %s; training on the other %d",
            len(skipped),
            len(skipped) + len(records),
            cfg.source,
            len(records),
        )
    return dataset


# --------------------------------------------------------------------------------------------
# Sampling


class EpochPosition:
    """Where a resumable sampler stands: the epoch and the samples all ranks consumed in it.

    The training loop calls `advance(n)` with what this rank consumed; `state_dict()` is what a
    checkpoint saves, `load_state_dict()` restores it (refusing data of another size).
    """

    epoch: int
    consumed: int
    num_replicas: int
    seed: int
    dataset_len: int

    @property
    def position(self) -> int:
        """Samples this rank consumed in the current epoch."""
        return self.consumed // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def advance(self, samples: int) -> None:
        """Record that this rank consumed `samples` more samples (every rank advances alike)."""
        self.consumed += samples * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "consumed": self.consumed,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("dataset_len", self.dataset_len) != self.dataset_len:
            raise DataError(
                f"the checkpoint was taken on {state['dataset_len']} samples but the data now has "
                f"{self.dataset_len}; resume with the same data, or start a new run"
            )
        self.epoch = int(state["epoch"])
        replicas = int(state.get("num_replicas", self.num_replicas))
        self.consumed = int(state.get("consumed", int(state["position"]) * replicas))


class ResumableDistributedSampler(EpochPosition, Sampler[SampleKey]):
    """DistributedSampler that can stop and resume mid-epoch exactly.

    Each epoch has one global order (a permutation seeded by `seed + epoch` when shuffling),
    truncated (`drop_last=True`) or wrapped around (`drop_last=False`) to a multiple of
    `num_replicas`; rank r takes every `num_replicas`-th element starting at r, as
    `torch.utils.data.DistributedSampler` does. It yields `SampleKey(index, epoch)`, so the
    dataset applies that epoch's augmentation even inside persistent DataLoader workers.

    Position is advanced explicitly: the training loop calls `advance(n)` with the number of
    samples this rank has consumed (after each optimizer step, or each micro-batch). Counting
    yielded indices would be wrong, since DataLoader workers prefetch batches that a stopped run
    never trained on. `state_dict()` -> `{"epoch", "position", ...}` where position is the
    samples this rank consumed in the epoch; after `load_state_dict()` the next iteration yields
    exactly the keys the uninterrupted run would have yielded from there on. `set_epoch(e)` with a
    new epoch resets the position to 0; calling it with the current epoch (as a loop does right
    after resuming) keeps the restored position.

    Resuming with a different `num_replicas` continues after the samples all ranks consumed
    together (`position * old_num_replicas`), so no sample of the epoch is repeated or lost
    beyond the remainder of a drop_last split.
    """

    def __init__(
        self,
        dataset: Dataset | int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.dataset_len = dataset if isinstance(dataset, int) else len(dataset)  # type: ignore[arg-type]
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if self.dataset_len < num_replicas and drop_last:
            raise DataError(
                f"{self.dataset_len} samples cannot be split across {num_replicas} ranks; "
                "add data or use fewer ranks"
            )
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # samples consumed by all ranks together in this epoch

    @property
    def total_size(self) -> int:
        n, w = self.dataset_len, self.num_replicas
        return n // w * w if self.drop_last else -(-n // w) * w

    @property
    def num_samples(self) -> int:
        """Samples per rank in a whole epoch."""
        return self.total_size // self.num_replicas

    def _order(self) -> torch.Tensor:
        """The epoch's global order of all items (same on every rank)."""
        n = self.dataset_len
        if not self.shuffle:
            return torch.arange(n)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g)

    def _rank_indices(self) -> list[int]:
        perm = self._order()
        n, w = self.dataset_len, self.num_replicas
        total = self.total_size
        start = min(self.consumed, total)
        remaining = total - start
        # Only after a world-size change can the remainder be uneven; wrap or trim it.
        end = start + (remaining // w * w if self.drop_last else -(-remaining // w) * w)
        if end > n:  # drop_last=False pads by wrapping around to the start of the order
            perm = perm.repeat(-(-end // n))
        return perm[start:end][self.rank :: w].tolist()

    def __iter__(self) -> Iterator[SampleKey]:
        epoch = self.epoch
        return iter([SampleKey(i, epoch) for i in self._rank_indices()])

    def __len__(self) -> int:
        """Samples this rank still yields in the current epoch (all of them at position 0)."""
        remaining = self.total_size - min(self.consumed, self.total_size)
        w = self.num_replicas
        return remaining // w if self.drop_last else -(-remaining // w)


# --------------------------------------------------------------------------------------------
# Loading


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors, turn ints into a LongTensor, keep strings as lists."""
    batch: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        first = values[0]
        if isinstance(first, torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(first, bool):
            batch[key] = torch.tensor(values, dtype=torch.bool)
        elif isinstance(first, int):
            batch[key] = torch.tensor(values, dtype=torch.long)
        else:
            batch[key] = values
    return batch


def batch_load_errors(batch: dict[str, Any]) -> list[str]:
    """Files that failed to decode while this batch was loaded (their stand-ins were used).

    Collect them into a set: a bad file is reported each time its index comes up.
    """
    return [error for error in batch.get("load_error", []) if error]


@dataclass
class _WorkerSeeder:
    """worker_init_fn: seeds each worker's global RNGs from (seed, rank, worker id).

    The bundled datasets do not use global RNGs; this keeps user transforms reproducible too.
    A dataclass rather than a closure so it pickles under the spawn start method.
    """

    seed: int
    rank: int

    def __call__(self, worker_id: int) -> None:
        seed = (self.seed * 1_000_003 + self.rank * 1009 + worker_id) % (2**32)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def build_dataloader(
    dataset: Dataset,
    sampler: ResumableDistributedSampler | Sampler | None,
    batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    drop_last: bool = True,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A DataLoader over `dataset` in `sampler` order, with dict collation and seeded workers.

    `drop_last=True` drops a final partial batch; every rank has the same number of samples,
    so batch sizes agree across ranks either way. Workers persist across epochs. A sampler that
    yields whole batches (trainer.buckets.BucketBatchSampler) is used as the batch sampler, and
    `batch_size` and `drop_last` are then its business.
    """
    rank = getattr(sampler, "rank", 0)
    generator = torch.Generator()
    generator.manual_seed(seed * 1009 + rank)
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs["persistent_workers"] = True
        kwargs["worker_init_fn"] = _WorkerSeeder(seed, rank)
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    if getattr(sampler, "yields_batches", False):
        kwargs["batch_sampler"] = sampler
    else:
        kwargs.update(batch_size=batch_size, sampler=sampler, shuffle=False, drop_last=drop_last)
    return DataLoader(
        dataset,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate,
        generator=generator,
        **kwargs,
    )


__all__ = [
    "CACHE_DIR_ENV",
    "DIGIT_CAPTION_TEMPLATES",
    "DIGIT_WORDS",
    "AugmentedDataset",
    "DataConfig",
    "DataError",
    "DigitsDataset",
    "FolderDataset",
    "ResumableDistributedSampler",
    "SampleKey",
    "SkippedFile",
    "batch_load_errors",
    "build_dataloader",
    "build_dataset",
    "cache_root",
    "collate",
    "default_cache_root",
    "crop_offsets",
    "flip_decision",
    "index_folder",
    "prompt_for_digit",
]
