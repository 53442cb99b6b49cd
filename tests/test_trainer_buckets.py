"""Aspect-ratio buckets (trainer/buckets.py) on a folder of mixed sizes the tests make: bucket
shapes, one bucket per step on every rank, exact resume of the batch order, the latent cache with
per-bucket arrays, and real 2-rank gloo runs that resume to identical losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_to_end, subprocess_env
from sddoctor.telemetry.reader import read_events
from trainer.buckets import (
    BucketBatchSampler,
    assign_buckets,
    bucket_sizes,
    check_bucket_settings,
    nearest_bucket,
)
from trainer.data import DataConfig, DataError, build_dataset

#: (width, height) of the test images: wide, tall and square, 16 of each
SHAPES = [(64, 32), (32, 64), (40, 40)]


def mixed_folder(root: Path, per_shape: int = 16) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for s, (w, h) in enumerate(SHAPES):
        for i in range(per_shape):
            name = f"img-{s}-{i:02d}.png"
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / name)
            rows.append({"file_name": name, "text": f"a handwritten digit {['one', 'two', 'three'][s]}"})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_buckets_cover_both_orientations_within_the_area():
    sizes = bucket_sizes(512, 64, 256, 1024)
    assert (512, 512) in sizes and (768, 320) in sizes and (320, 768) in sizes
    assert all(w * h <= 512 * 512 and w % 64 == 0 and h % 64 == 0 for w, h in sizes)
    assert sizes[nearest_bucket((1920, 1080), sizes)] == (640, 384)  # 16:9 -> 5:3
    assert sizes[nearest_bucket((1000, 1000), sizes)] == (512, 512)
    with pytest.raises(DataError, match="not a multiple of 64"):
        check_bucket_settings(DataConfig(resolution=512, buckets=True, bucket_step=32), 64)
    with pytest.raises(DataError, match="do not fit data.resolution=512"):
        check_bucket_settings(DataConfig(resolution=512, buckets=True, bucket_min=576), 64)


def test_images_are_cropped_to_their_bucket(tmp_path):
    cfg = DataConfig(source=str(mixed_folder(tmp_path)), resolution=32, buckets=True, num_workers=0)
    dataset = build_dataset(cfg)
    buckets = assign_buckets(dataset, cfg, model_step=8)
    assert all(w * h <= 32 * 32 for w, h in buckets)
    by_shape = {dataset.target_size(i) for i in range(len(dataset))}
    assert by_shape == {(40, 24), (24, 40), (32, 32)}
    for i in (0, 16, 32):
        w, h = dataset.target_size(i)
        assert dataset[i]["pixel_values"].shape == (3, h, w)


def batches_of(sampler: BucketBatchSampler) -> list[list[int]]:
    return [[key.index for key in batch] for batch in sampler]


def test_every_rank_gets_the_same_bucket_and_size_each_step_and_resumes_exactly():
    sizes = [SHAPES[i // 16] for i in range(48)] + [(8, 8)] * 5  # a bucket too small for one step
    ranks = [BucketBatchSampler(sizes, batch_size=4, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
    steps = list(zip(*(batches_of(s) for s in ranks), strict=True))
    assert len(steps) == ranks[0].batches_per_epoch == 6  # 2 whole global batches of 8 per 16-image bucket
    seen: set[int] = set()
    for a, b in steps:
        assert len(a) == len(b) == 4
        assert len({sizes[i] for i in a + b}) == 1  # one bucket for the whole step, on both ranks
        assert not seen & set(a + b)
        seen |= set(a + b)
    assert len({sizes[a[0]] for a, _ in steps}) == 3
    assert [sizes[a[0]] for a, _ in steps] != sorted(sizes[a[0]] for a, _ in steps)  # buckets interleaved

    for sampler in ranks:  # two steps consumed, a checkpoint, a fresh sampler: the same rest
        sampler.advance(4)
        sampler.advance(4)
    restored = [BucketBatchSampler(sizes, batch_size=4, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
    for old, new in zip(ranks, restored, strict=True):
        new.load_state_dict(old.state_dict())
        assert batches_of(new) == [step[old.rank] for step in steps[2:]]
        new.set_epoch(1)
        assert len(batches_of(new)) == 6 and batches_of(new) != [step[old.rank] for step in steps]
    with pytest.raises(DataError, match="no aspect-ratio bucket holds one step's 64 images"):
        BucketBatchSampler(sizes, batch_size=32, num_replicas=2)


STEPS = 8
RUN = [
    "model.vae_warmup_steps=4",
    f"train.max_steps={STEPS}",
    "train.micro_batch=2",
    "train.grad_accum=2",
    "train.log_every=2",
    "checkpoint.every=4",
    "checkpoint.keep=0",
    "sample.at_end=false",
    "output.export=false",
    "data.buckets=true",
    "data.random_flip=true",
    "data.center_crop=false",
]


def train(data: Path, out: Path, cache: Path, *extra: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer",
    ]
    cmd += ["--output-dir", str(out), "--set", f"data.source={data}", f"data.cache_dir={cache}", *RUN, *extra]
    code, text = run_to_end(cmd, timeout=300, env=subprocess_env(SDDOCTOR_PREFLIGHT="0"))
    assert code == 0, text[-4000:]
    return text


def losses(out: Path, rank: int) -> dict[int, float]:
    return {
        e["step"]: e["loss"] for e in read_events(out / "ranks" / f"rank-{rank:05d}.jsonl", kinds={"step"})
    }


@pytest.mark.slow
def test_two_ranks_train_on_buckets_with_the_cache_and_resume_exactly(tmp_path):
    data = mixed_folder((tmp_path / "data").mkdir() or tmp_path / "data")
    out, cache = tmp_path / "run", tmp_path / "cache"
    text = train(data, out, cache)
    assert "3 aspect-ratio bucket(s) in use (" in text and "40x24: 16" in text and "24x40: 16" in text
    assert "latent cache built" in text
    shards = list(cache.glob("*/images-00000-of-00002"))
    assert len(shards) == 1 and {p.name for p in shards[0].glob("mean.*")} == {
        "mean.24x40.npy",
        "mean.32x32.npy",
        "mean.40x24.npy",
    }
    digests = [read_events(out / "ranks" / f"rank-{r:05d}.jsonl", kinds={"replicas"})[-1] for r in (0, 1)]
    assert digests[0]["params_sha256"] == digests[1]["params_sha256"]

    resumed = tmp_path / "resumed"
    text = train(data, resumed, cache, "--resume", str(out / "checkpoints" / "step-00000004"))
    assert "latent cache hit" in text and "at step 4" in text
    for rank in (0, 1):
        assert losses(resumed, rank) == {s: v for s, v in losses(out, rank).items() if s > 4}
