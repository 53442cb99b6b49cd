"""Atomic, resumable checkpoints.

    OUTPUT_DIR/checkpoints/step-00000100/
        state.pt          shared state (rank 0): UNet, EMA, optimizer, LR scheduler, scaler, VAE, step
        rank-00000.pt     per-rank state: RNG states (python, numpy, torch, cuda, the noise generator), data position
        rank-00001.pt
        meta.json         written last: step, world size, time; its presence marks a complete checkpoint

Every rank writes into `.tmp-step-00000100/` and fsyncs its file; rank 0 then writes meta.json,
fsyncs, and renames the folder to its final name in one `rename`. A kill at any moment leaves
either the previous checkpoints untouched or the new one complete: readers only look at
`step-*` folders that hold meta.json. With several nodes the checkpoint folder must be on a
filesystem all nodes share.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_FINAL = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A --resume target that does not exist or is incomplete. Exit code 2."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            m = _FINAL.match(entry.name)
            if m and (entry / "meta.json").is_file():
                found.append((int(m.group(1)), entry))
    return sorted(found)


def find_latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """'' -> None; 'latest' -> newest complete checkpoint under root (None if there is none); else a path."""
    if not resume:
        return None
    if resume == "latest":
        return find_latest(root)
    path = Path(resume)
    if not (path / "meta.json").is_file():
        hint = f"; complete checkpoints under {root}: {[p.name for _, p in list_checkpoints(root)]}"
        raise CheckpointError(f"--resume {resume}: not a complete checkpoint folder (no meta.json){hint}")
    return path


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    shared_state: Callable[[], dict[str, Any]],
    rank_state: dict[str, Any],
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    keep: int = 0,
) -> Path:
    """Write a checkpoint collectively (every rank calls this). Returns the final folder."""
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    _save_synced(rank_state, tmp / f"rank-{rank:05d}.pt")
    if rank == 0:
        _save_synced(shared_state(), tmp / "state.pt")
    barrier()
    if rank == 0:
        meta = {"step": step, "world_size": world_size, "time": time.time()}
        with open(tmp / "meta.json", "w", encoding="utf-8") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # saving the same step again (e.g. a signal right after a periodic save)
            stale = root / f".old-{checkpoint_name(step)}-{os.getpid()}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for _, old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(shared state, this rank's state or None if the checkpoint had fewer ranks, meta)."""
    meta = json.loads((path / "meta.json").read_text())
    shared = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    rank_file = path / f"rank-{rank:05d}.pt"
    per_rank = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else None
    return shared, per_rank, meta
