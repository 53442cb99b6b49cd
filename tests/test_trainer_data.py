"""Datasets, augmentation, corrupt images and the resumable sampler (CPU, no models)."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.data import (
    DIGIT_WORDS,
    DataConfig,
    DataError,
    ResumableDistributedSampler,
    SampleKey,
    build_dataloader,
    build_dataset,
    prompt_for_digit,
)


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the image verification memo out of the user's ~/.cache."""
    monkeypatch.setenv("SDDOCTOR_CACHE_DIR", str(tmp_path / "cache-home"))
    return tmp_path / "cache-home"


def write_png(path: Path, size: tuple[int, int] = (20, 12), seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_truncated_jpeg(path: Path) -> None:
    """A JPEG cut in its scan data: PIL's verify() passes it, decoding fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    noise = np.random.default_rng(9).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) * 3 // 4])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    """Top-level metadata plus a nested folder with its own metadata (paths relative to it)."""
    root = tmp_path / "imagefolder"
    for i in range(3):
        write_png(root / f"img{i}.png", seed=i)
    write_jsonl(root / "metadata.jsonl", [{"file_name": f"img{i}.png", "text": f"top {i}"} for i in range(3)])
    write_png(root / "sub" / "deep" / "a.png", size=(9, 30), seed=9)
    # Saved with a byte-order mark, as some Windows editors do.
    (root / "sub" / "metadata.jsonl").write_text(
        json.dumps({"file_name": "deep/a.png", "text": ["nested", "alt"]}) + "\n", encoding="utf-8-sig"
    )
    return root


def test_imagefolder_items_nested_metadata_and_value_range(imagefolder: Path) -> None:
    ds = build_dataset(DataConfig(source=str(imagefolder), resolution=8))
    assert ds.kind == "imagefolder"
    assert len(ds) == 4 and ds.skipped == []
    captions = sorted(ds[i]["caption"] for i in range(len(ds)))
    assert captions == ["nested", "top 0", "top 1", "top 2"]
    for i in range(len(ds)):
        item = ds[i]
        assert item["index"] == i and item["load_error"] == ""
        px = item["pixel_values"]
        assert px.shape == (3, 8, 8) and px.dtype == torch.float32
        assert -1.0 <= px.min() and px.max() <= 1.0 and px.min() < -0.5 and px.max() > 0.5


def test_caption_pairs_nested_and_image_without_caption_skipped(tmp_path: Path, caplog) -> None:
    root = tmp_path / "pairs"
    write_png(root / "cat.png")
    (root / "cat.txt").write_text("a cat\n")
    write_png(root / "more" / "dog.png", seed=2)
    (root / "more" / "dog.txt").write_text("a dog")
    write_png(root / "lonely.png", seed=3)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        ds = build_dataset(DataConfig(source=str(root), resolution=8))
    assert ds.kind == "captions"
    assert sorted(ds.captions()) == ["a cat", "a dog"]
    assert [Path(s.path).name for s in ds.skipped] == ["lonely.png"]
    assert "lonely.png" in caplog.text


def test_digits_items_captions_and_ink_on_white() -> None:
    ds = build_dataset(DataConfig(source="digits", resolution=16))
    assert len(ds) == 1797
    labels = ds.labels
    for i in (0, 1, 2, 7, 100):
        item = ds[i]
        word = DIGIT_WORDS[int(labels[i])]
        assert word in item["caption"].split() or f"{word}," in item["caption"]
        assert "handwritten" in item["caption"] or "by hand" in item["caption"]
        px = item["pixel_values"]
        assert px.shape == (3, 16, 16)
        assert torch.equal(px[0], px[1]) and torch.equal(px[1], px[2])  # gray in three channels
        assert px[:, 0, 0].min() > 0.9  # paper corner is white
        assert px.min() < -0.5  # some dark ink
    assert ds[0]["caption"] == prompt_for_digit(int(labels[0])) == "a handwritten digit zero"
    assert len(build_dataset(DataConfig(source="digits", resolution=16, max_samples=10))) == 10


def test_random_crop_and_flip_depend_only_on_seed_epoch_index(tmp_path: Path) -> None:
    root = tmp_path / "wide"
    write_png(root / "w.png", size=(40, 10), seed=5)
    (root / "w.txt").write_text("wide")
    cfg = DataConfig(source=str(root), resolution=8, center_crop=False, random_flip=True)
    ds = build_dataset(cfg, seed=1)
    per_epoch = [ds[SampleKey(0, e)]["pixel_values"] for e in range(12)]
    again = build_dataset(cfg, seed=1)
    for e in range(12):
        assert torch.equal(again[SampleKey(0, e)]["pixel_values"], per_epoch[e])
    assert len({p.numpy().tobytes() for p in per_epoch}) > 3  # crops/flips vary by epoch
    center = build_dataset(DataConfig(source=str(root), resolution=8), seed=1)
    assert len({center[SampleKey(0, e)]["pixel_values"].numpy().tobytes() for e in range(6)}) == 1


def test_corrupt_images_skipped_with_named_warning_and_counted(tmp_path: Path, caplog) -> None:
    root = tmp_path / "mixed"
    rows = []
    for i in range(4):
        write_png(root / f"ok{i}.png", seed=i)
        rows.append({"file_name": f"ok{i}.png", "text": f"ok {i}"})
    (root / "garbage.png").write_bytes(b"this is not an image at all")
    good = (root / "ok0.png").read_bytes()
    (root / "truncated.png").write_bytes(good[: len(good) // 2])
    rows += [{"file_name": "garbage.png", "text": "bad"}, {"file_name": "truncated.png", "text": "bad"}]
    rows.append({"file_name": "missing.png", "text": "gone"})
    write_jsonl(root / "metadata.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        ds = build_dataset(DataConfig(source=str(root), resolution=8))
    assert len(ds) == 4
    assert sorted(Path(s.path).name for s in ds.skipped) == ["garbage.png", "missing.png", "truncated.png"]
    for name in ("garbage.png", "truncated.png", "missing.png"):
        assert name in caplog.text
    assert "skipped 3 of 7 images" in caplog.text

    # A truncated JPEG passes the indexing check but fails to decode: the next readable item
    # stands in, deterministically, and the failure is reported.
    write_truncated_jpeg(root / "sub" / "cut.jpg")
    write_jsonl(root / "sub" / "metadata.jsonl", [{"file_name": "cut.jpg", "text": "cut"}])
    ds = build_dataset(DataConfig(source=str(root), resolution=8))
    assert len(ds) == 5
    broken = root / "sub" / "cut.jpg"
    index = [r.path for r in ds.records].index(broken)
    item = ds[index]
    assert item["load_error"] == str(broken)
    assert item["caption"] == ds.caption((index + 1) % 5) and item["pixel_values"].shape == (3, 8, 8)
    assert torch.equal(item["pixel_values"], ds[index]["pixel_values"])
    assert ds[index]["load_error"] == str(broken)  # still reported on every use
    assert str(broken) in [s.path for s in ds.skipped]


def test_verification_is_remembered_until_a_file_changes(tmp_path: Path, cache_home: Path) -> None:
    root = tmp_path / "memo"
    for i in range(3):
        write_png(root / f"{i}.png", seed=i)
        (root / f"{i}.txt").write_text(f"image {i}")
    (root / "bad.png").write_bytes(b"garbage")
    (root / "bad.txt").write_text("bad")
    cfg = DataConfig(source=str(root), resolution=8)
    assert len(build_dataset(cfg)) == 3
    assert len(list((cache_home / "verified").glob("*.json"))) == 1

    # Fixed file (new size and mtime): verified again and used.
    write_png(root / "bad.png", seed=7)
    assert len(build_dataset(cfg)) == 4

    # Unchanged size and mtime: the memo is trusted, so a file corrupted in place without either
    # changing passes indexing; loading catches it and substitutes.
    target = root / "1.png"
    st = target.stat()
    target.write_bytes(b"\0" * st.st_size)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    ds = build_dataset(cfg)
    assert len(ds) == 4 and ds.skipped == []
    index = [r.path for r in ds.records].index(target)
    assert ds[index]["load_error"] == str(target)
    assert len(build_dataset(DataConfig(source=str(root), resolution=8, cache_dir=str(tmp_path / "x")))) == 3


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("missing", "does not exist"),
        ("empty", "no images found"),
        ("file", "is not a folder"),
        ("no_text_column", "no column 'text'"),
        ("bad_json", "not valid JSON"),
        ("no_captions", "has a caption"),
    ],
)
def test_bad_folders_raise_data_error_with_fix(tmp_path: Path, layout: str, expected: str) -> None:
    root = tmp_path / "data"
    if layout == "empty":
        root.mkdir()
        (root / "notes.md").write_text("nothing here")
    elif layout == "file":
        root.write_text("not a folder")
    elif layout == "no_text_column":
        write_png(root / "a.png")
        write_jsonl(root / "metadata.jsonl", [{"file_name": "a.png", "caption": "x"}])
    elif layout == "bad_json":
        write_png(root / "a.png")
        (root / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "x"}\n{oops\n')
    elif layout == "no_captions":
        write_png(root / "a.png")
    with pytest.raises(DataError) as err:
        build_dataset(DataConfig(source=str(root), resolution=8))
    message = str(err.value)
    assert expected in message
    assert str(root) in message or "metadata.jsonl" in message
    if layout == "no_text_column":
        assert "data.caption_column" in message and "caption" in message


@pytest.mark.parametrize(
    ("file_name", "expected"),
    [
        ("../outside.png", "contains '..'"),
        ("sub/../../outside.png", "contains '..'"),
        ("OUTSIDE_ABSOLUTE", "is an absolute path"),
        (".link-out.png", "outside the data folder"),
        (".linked-dir/outside.png", "outside the data folder"),
        (7, "must be a non-empty string"),
        (None, "must be a non-empty string"),
        ("", "must be a non-empty string"),
        (["a.png"], "must be a non-empty string"),
    ],
)
def test_metadata_file_names_must_stay_inside_the_folder(tmp_path: Path, file_name, expected: str) -> None:
    outside = write_png(tmp_path / "outside.png")
    root = tmp_path / "data"
    write_png(root / "a.png")
    # Hidden, so the folder walk passes them by: only a metadata row can name them.
    (root / ".link-out.png").symlink_to(outside)
    (root / ".linked-dir").symlink_to(tmp_path, target_is_directory=True)
    (root / "link-in.png").symlink_to(root / "a.png")  # a link that stays inside is fine
    if file_name == "OUTSIDE_ABSOLUTE":
        file_name = str(outside)
    write_jsonl(
        root / "metadata.jsonl",
        [{"file_name": "link-in.png", "text": "ok"}, {"file_name": file_name, "text": "x"}],
    )
    with pytest.raises(DataError) as err:
        build_dataset(DataConfig(source=str(root), resolution=8))
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert "metadata.jsonl:2" in str(err.value) or "link" in str(err.value)


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_png(root / "a.png")
    (root / "link-in.png").symlink_to(root / "a.png")
    write_jsonl(
        root / "metadata.jsonl",
        [{"file_name": "a.png", "text": "a"}, {"file_name": "link-in.png", "text": "b"}],
    )
    assert build_dataset(DataConfig(source=str(root), resolution=8)).captions() == ["a", "b"]


def test_caption_pairs_refuse_links_out_of_the_folder(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write_png(elsewhere / "secret.png")
    (elsewhere / "secret.txt").write_text("a private photo")
    root = tmp_path / "data"
    write_png(root / "a.png")
    (root / "a.txt").write_text("a")
    (root / "more").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DataError, match="outside the data folder"):
        build_dataset(DataConfig(source=str(root), resolution=8))
    (root / "more").unlink()
    (root / "b.png").symlink_to(elsewhere / "secret.png")
    with pytest.raises(DataError, match="b.png leads to"):
        build_dataset(DataConfig(source=str(root), resolution=8))


@pytest.mark.parametrize(
    ("caption", "expected"),
    [
        ("a cat", "a cat"),
        (["first", "second"], "first"),
        ("", ""),
        (3, None),
        (None, None),
        ([], None),
        ([1], None),
        ({"en": "x"}, None),
        (True, None),
    ],
)
def test_captions_are_strings_or_lists_of_strings(tmp_path: Path, caption, expected) -> None:
    root = tmp_path / "data"
    write_png(root / "a.png")
    write_jsonl(root / "metadata.jsonl", [{"file_name": "a.png", "text": caption}])
    if expected is None:
        with pytest.raises(DataError, match=r"metadata.jsonl:1: text must be a string"):
            build_dataset(DataConfig(source=str(root), resolution=8))
    else:
        assert build_dataset(DataConfig(source=str(root), resolution=8)).captions() == [expected]


def _epoch_keys(sampler: ResumableDistributedSampler) -> list[tuple[int, int]]:
    return [(k.index, k.epoch) for k in sampler]


def test_sampler_replicas_disjoint_and_cover() -> None:
    samplers = [ResumableDistributedSampler(23, num_replicas=2, rank=r, seed=4) for r in range(2)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        parts = [[i for i, _ in _epoch_keys(s)] for s in samplers]
        assert len(parts[0]) == len(parts[1]) == 11
        assert not set(parts[0]) & set(parts[1])
        assert len(set(parts[0]) | set(parts[1])) == 22
    padded = [ResumableDistributedSampler(23, 2, r, drop_last=False) for r in range(2)]
    assert sorted({i for s in padded for i, _ in _epoch_keys(s)}) == list(range(23))
    assert len(list(padded[0])) == len(list(padded[1])) == 12
    assert _epoch_keys(samplers[0]) != [(i, 1) for i in range(0, 22, 2)]  # shuffled


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_matches_torch_distributed_sampler_order(drop_last: bool) -> None:
    from torch.utils.data.distributed import DistributedSampler

    for rank in range(3):
        ours = ResumableDistributedSampler(25, 3, rank, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(25), 3, rank, seed=5, drop_last=drop_last)
        for epoch in (0, 4):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert [k.index for k in ours] == list(theirs) and len(ours) == len(theirs)


def test_sampler_resume_mid_epoch_is_exact() -> None:
    def run(stop_after: int | None) -> tuple[list[list[tuple[int, int]]], dict]:
        """Two ranks, 3 epochs of batches of 3; stop after `stop_after` batches if given."""
        samplers = [ResumableDistributedSampler(31, 2, r, seed=7) for r in range(2)]
        seen: list[list[tuple[int, int]]] = [[], []]
        done = 0
        for epoch in range(3):
            for s in samplers:
                s.set_epoch(epoch)
            iters = [iter(s) for s in samplers]
            for _ in range(len(samplers[0]) // 3):
                for rank, it in enumerate(iters):
                    seen[rank].extend((k.index, k.epoch) for k in (next(it) for _ in range(3)))
                    samplers[rank].advance(3)
                done += 1
                if done == stop_after:
                    return seen, {"states": [s.state_dict() for s in samplers]}
        return seen, {}

    full, _ = run(None)
    head, saved = run(7)  # 5 batches per epoch: stops in the middle of epoch 1
    assert saved["states"][0]["epoch"] == 1 and saved["states"][0]["position"] == 6
    tail: list[list[tuple[int, int]]] = [[], []]
    samplers = []
    for rank, state in enumerate(saved["states"]):
        s = ResumableDistributedSampler(31, 2, rank, seed=7)
        s.load_state_dict(json.loads(json.dumps(state)))
        samplers.append(s)
    for epoch in range(1, 3):
        for s in samplers:
            s.set_epoch(epoch)  # same epoch as restored: keeps the position
        for rank, s in enumerate(samplers):
            keys = _epoch_keys(s)[: len(s) // 3 * 3]
            tail[rank].extend(keys)
            s.advance(len(keys))
    for rank in range(2):
        assert head[rank] + tail[rank] == full[rank]


def test_sampler_resume_on_fewer_ranks_continues_the_epoch() -> None:
    old = [ResumableDistributedSampler(20, 2, r, seed=1) for r in range(2)]
    consumed = set()
    for s in old:
        consumed.update(i for i, _ in _epoch_keys(s)[:4])
        s.advance(4)
    new = ResumableDistributedSampler(20, 1, 0, seed=1)
    new.load_state_dict(old[0].state_dict())
    rest = [i for i, _ in _epoch_keys(new)]
    assert len(rest) == 12 and not consumed & set(rest) and len(consumed | set(rest)) == 20


def test_dataloader_with_prefetching_workers_resumes_exactly(tmp_path: Path) -> None:
    cfg = DataConfig(source="digits", resolution=8, random_flip=True, max_samples=40)
    ds = build_dataset(cfg, seed=3)

    def batches(sampler: ResumableDistributedSampler, limit: int | None) -> list[dict]:
        loader = build_dataloader(ds, sampler, batch_size=4, num_workers=2, seed=3)
        out = []
        for epoch in range(sampler.epoch, 2):
            sampler.set_epoch(epoch)
            for batch in loader:
                out.append(batch)
                sampler.advance(len(batch["index"]))
                if limit is not None and len(out) == limit:
                    return out  # workers have prefetched batches past this point
        return out

    full = batches(ResumableDistributedSampler(ds, 2, 1, seed=3), None)
    first = ResumableDistributedSampler(ds, 2, 1, seed=3)
    head = batches(first, 7)
    resumed = ResumableDistributedSampler(ds, 2, 1, seed=3)
    resumed.load_state_dict(first.state_dict())
    tail = batches(resumed, None)
    assert len(full) == 10 and len(head) + len(tail) == 10
    for a, b in zip(full, head + tail, strict=True):
        assert torch.equal(a["index"], b["index"])
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert a["caption"] == b["caption"]
    # Workers produce what the dataset gives in-process for the same key.
    direct = [ds[SampleKey(int(i), 0)]["pixel_values"] for i in full[0]["index"]]
    assert torch.equal(full[0]["pixel_values"], torch.stack(direct))
