"""Time a checkpoint of a 3 GiB state (1 GiB of weights + two Adam moments): this format vs torch.save.

    PYTHONPATH=. python scripts/checkpoint_bench.py [FOLDER]      (FOLDER default: a temporary one)

Prints the seconds to save (write, fsync, sha256), verify (what a resume checks) and load, and
the seconds torch.save / torch.load(weights_only=False) take for the same state.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainer.checkpoint import choose_checkpoint, load_checkpoint, save_checkpoint


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="ckbench-"))
    tensors, elements = 32, 8 << 20  # 32 tensors of 32 MiB
    weights = {f"w{i}": torch.randn(elements) for i in range(tensors)}
    moments = {
        i: {"exp_avg": torch.randn(elements), "exp_avg_sq": torch.rand(elements)} for i in range(tensors)
    }
    state = {"unet": weights, "optimizer": {"state": moments}}
    root = folder / "checkpoints"
    t = time.perf_counter()
    save_checkpoint(root, 1, lambda: state, {"position": 0}, 0, 1, lambda: None)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    resume = choose_checkpoint("latest", root, 0, 1, False, lambda v: [v], print)
    verify_s = time.perf_counter() - t
    t = time.perf_counter()
    load_checkpoint(resume, 0)
    load_s = time.perf_counter() - t
    old = folder / "state.pt"
    t = time.perf_counter()
    with open(old, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    torch_save_s = time.perf_counter() - t
    t = time.perf_counter()
    torch.load(old, weights_only=False)
    torch_load_s = time.perf_counter() - t
    print(
        f"3.0 GiB: save {save_s:.1f}s, verify {verify_s:.1f}s, load {load_s:.1f}s | "
        f"torch.save {torch_save_s:.1f}s, torch.load {torch_load_s:.1f}s"
    )
    shutil.rmtree(root)
    old.unlink()


if __name__ == "__main__":
    main()
