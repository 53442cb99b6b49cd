"""Tiny and uneven data on 1-4 real ranks (gloo): every loop over data ends.

Each case is a real run of the tiny preset (torchrun for several ranks): the VAE fit with a batch
larger than a rank's share of the data (it once spun forever), the latent cache with shards of
unequal size or without a caption to encode on some ranks, two training steps, a checkpoint,
sampling and the export. Too little data for one step is exit 2 with the numbers, at once.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import REPO_ROOT, run_to_end, subprocess_env
from trainer.checkpoint import list_checkpoints


def same_caption_folder(root: Path, count: int) -> Path:
    """`count` images that all share one caption: only one caption to encode for all ranks."""
    root.mkdir(parents=True)
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 256, (12, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text("a small picture")
    return root


def train(tmp_path: Path, ranks: int, *overrides: str) -> tuple[int, str]:
    launcher = [sys.executable, "-m", "trainer"]
    if ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
        ]
        launcher += ["-m", "trainer"]
    cmd = launcher + [
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        "train.max_steps=2",
        "train.log_every=1",
        "model.vae_warmup_steps=2",
        "data.num_workers=0",
        f"data.cache_dir={tmp_path / 'cache'}",
        "sample.prompts=a handwritten digit one",
        "sample.images_per_prompt=1",
        "sample.steps=2",
        *overrides,
    ]
    return run_to_end(cmd, timeout=400, env=subprocess_env(SDDOCTOR_PREFLIGHT="0"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "samples", "micro_batch", "cache", "folder"),
    [
        (1, 8, 2, False, False),  # VAE batch 16 > 8 images: the run that spun forever
        (2, 3, 1, True, False),  # 3 images on 2 ranks: cache shards of 2 and 1, one image unused a step
        (3, 4, 1, True, False),  # 4 images on 3 ranks: shards 2, 1, 1
        (4, 9, 2, True, True),  # one caption for 4 ranks: 3 ranks have none to encode
    ],
)
def test_tiny_and_uneven_data_runs_to_the_end(tmp_path, ranks, samples, micro_batch, cache, folder):
    source = str(same_caption_folder(tmp_path / "images", samples)) if folder else "digits"
    code, output = train(
        tmp_path,
        ranks,
        f"data.source={source}",
        f"data.max_samples={samples}",
        f"train.micro_batch={micro_batch}",
        f"data.cache={str(cache).lower()}",
    )
    assert code == 0, output[-4000:]
    assert "Traceback" not in output
    assert "vae fit: batch 16 is more than the" in output
    saved = list_checkpoints(tmp_path / "out" / "checkpoints")
    assert [s for s, _ in saved] == [2]
    assert len(list(saved[0][1].glob("rank-*.safetensors"))) == ranks
    assert (tmp_path / "out" / "samples" / "latest.png").is_file()
    assert (tmp_path / "out" / "export" / "model_index.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "samples", "micro_batch", "expected"),
    [
        (1, 2, 4, "each rank gets 2 images per epoch (2 over 1 ranks), fewer than one step's 4"),
        (2, 1, 1, "each rank gets 0 images per epoch (1 over 2 ranks)"),
    ],
)
def test_too_little_data_for_one_step_is_exit_2(tmp_path, ranks, samples, micro_batch, expected):
    code, output = train(tmp_path, ranks, f"data.max_samples={samples}", f"train.micro_batch={micro_batch}")
    assert expected in output and "lower train.micro_batch or add data" in output, output[-3000:]
    assert "model preset:tiny" not in output  # refused before any model was built
    assert f'File "{REPO_ROOT / "trainer"}' not in output, output[-3000:]  # no traceback of the trainer's
    if ranks == 1:
        assert code == 2 and "Traceback" not in output
    else:  # torchrun reports its ranks' exit code (and a traceback of its own)
        assert code != 0 and re.search(r"exitcode\s*:\s*2", output), output[-3000:]
