"""Atomic, verified, resumable checkpoints that never unpickle.

    OUTPUT_DIR/checkpoints/step-00000100/
        state.safetensors       every tensor of the shared state (rank 0): UNet, EMA, optimizer
                                moments, fitted VAE, text encoder of a preset
        state.json              the rest (step, LR schedule, scaler, samplers, config, OOM guard),
                                tensors referenced by name; size + sha256 of state.safetensors
        rank-00000.safetensors  per-rank tensors: RNG states (python, numpy, torch, CUDA, step generator)
        rank-00000.json         per-rank rest (data position); size + sha256 of its tensors
        meta.json               written last: format, step, world size, library versions, and the
                                size + sha256 of every .json file; its presence marks a complete checkpoint

Loading reads JSON and safetensors only (`trainer.safe_state`); nothing in a checkpoint can run
code. Every rank writes into `.tmp-step-00000100/` and fsyncs its files; rank 0 then writes
meta.json, fsyncs, and renames the folder in one `rename`, so a kill at any moment leaves the
previous checkpoints untouched or the new one complete. With several nodes the checkpoint folder
must be on a filesystem all nodes share.

Before resuming, every rank verifies what it will read (sizes and sha256 of the shared files and
its own rank file) and the ranks agree on a verdict (`choose_checkpoint`):

* damaged (a file truncated, changed, unparseable, or the shared state missing): `--resume latest`
  reports it in one line and takes the previous complete checkpoint; `--resume PATH` stops (exit 2);
* a missing rank file, or another world size than the checkpoint's: refused (exit 2) with the
  fix, unless `checkpoint.reshard=true` continues without the per-rank states (weights,
  optimizer, schedule and data position carry over; random streams restart);
* the earlier pickle format (`state.pt`): refused with the command that converts it
  (`python -m trainer.checkpoint convert PATH`, `torch.load(weights_only=True)` on torch >= 2.6).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import torch

from trainer.safe_state import (
    StateFormatError,
    check_digest,
    decode,
    encode,
    file_digest,
    read_json,
    read_safetensors,
    write_json,
    write_safetensors,
)

FORMAT = "sddoctor-trainer-checkpoint"
VERSION = 2
_FINAL = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A --resume target that cannot be used as it is (missing, damaged, refused). Exit code 2."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` (folders holding meta.json), oldest first."""
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


# -- RNG states as tensors ------------------------------------------------------------------


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG of this process as tensors and numbers (no numpy objects, no pickles)."""
    version, mt, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # the legacy global generator is always MT19937: a tuple
    algorithm, key, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "algorithm": algorithm,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Restore `rng_state()`; CheckpointError when the state is malformed."""
    try:
        py, npy = state["python"], state["numpy"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        np.random.set_state(
            (
                str(npy["algorithm"]),
                npy["key"].numpy().astype(np.uint32),
                int(npy["pos"]),
                int(npy["has_gauss"]),
                float(npy["cached_gaussian"]),
            )
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if generator is not None and "generator" in state:
            generator.set_state(state["generator"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"the checkpoint's RNG state is malformed ({exc})") from None


def fresh_rng_state(seed: int, step: int, rank: int, generator: torch.Generator) -> None:
    """Seed every RNG from (seed, step, rank): a re-sharded resume's random streams."""
    mixed = (seed * 1_000_003 + step * 7919 + rank) % (2**32)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    generator.manual_seed(mixed)


# -- writing --------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Library versions recorded in meta.json (for the reader of a shared checkpoint)."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "safetensors", "sddoctor"):
        try:
            from importlib.metadata import version

            found[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed, or installed without metadata
            continue
    return found


def _write_part(folder: Path, stem: str, state: Any) -> dict[str, Any]:
    """stem.safetensors + stem.json for one state tree; returns the JSON file's size and sha256."""
    tree, tensors = encode(state)
    tensor_file = write_safetensors(folder / f"{stem}.safetensors", tensors, {"format": "pt"})
    return write_json(
        folder / f"{stem}.json",
        {
            "format": FORMAT,
            "version": VERSION,
            "tensors": {"file": f"{stem}.safetensors", **tensor_file},
            "tree": tree,
        },
    )


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
    _write_part(tmp, rank_name(rank), rank_state)
    if rank == 0:
        _write_part(tmp, "state", shared_state())
    barrier()
    if rank == 0:
        # The rank files' JSON are small: rank 0 reads back their checksums for meta.json.
        files = {"state.json": file_digest(tmp / "state.json")}
        for r in range(world_size):
            files[f"{rank_name(r)}.json"] = file_digest(tmp / f"{rank_name(r)}.json")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": world_size,
            "time": time.time(),
            "versions": versions(),
            "files": files,
        }
        write_json(tmp / "meta.json", meta)
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


# -- verifying and choosing -----------------------------------------------------------------

OK, DAMAGED, REFUSED = "ok", "damaged", "refused"


@dataclass(frozen=True)
class Verdict:
    kind: str  # OK | DAMAGED | REFUSED
    reason: str = ""
    step: int = 0
    saved_ranks: int = 0
    per_rank: bool = False


@dataclass(frozen=True)
class Resume:
    """The checkpoint to resume from, as all ranks agreed."""

    path: Path
    step: int
    world_size: int
    per_rank: bool
    """False when re-sharding: the per-rank states (RNG) are not used."""


def old_format(path: Path) -> bool:
    return (path / "state.pt").is_file() and not (path / "state.json").is_file()


def missing_ranks(path: Path, saved_ranks: int) -> list[int]:
    """Ranks whose .json or .safetensors file is absent from the checkpoint."""
    return [
        r
        for r in range(saved_ranks)
        if not all((path / f"{rank_name(r)}{ext}").is_file() for ext in (".json", ".safetensors"))
    ]


def _meta(path: Path) -> dict[str, Any]:
    meta = read_json(path / "meta.json")
    if not isinstance(meta, dict):
        raise StateFormatError("meta.json is not a JSON object")
    return meta


def inspect_checkpoint(path: Path, rank: int, world_size: int, reshard: bool) -> Verdict:
    """What this rank finds in `path`: OK, DAMAGED (with why) or REFUSED (with the fix)."""
    if old_format(path):
        return Verdict(
            REFUSED,
            f"checkpoint {path} is in the earlier pickle format (state.pt), which resuming never loads "
            "because unpickling a file can run code. If you trust where it came from, convert it once "
            f"with `python -m trainer.checkpoint convert {path}` (torch >= 2.6, weights_only loading)",
        )
    try:
        meta = _meta(path)
    except StateFormatError as exc:
        return Verdict(DAMAGED, str(exc))
    if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int):
        return Verdict(DAMAGED, "meta.json does not describe a trainer checkpoint")
    if meta["version"] > VERSION:
        return Verdict(
            REFUSED,
            f"checkpoint {path} has format version {meta['version']}; this trainer reads up to {VERSION}: "
            "update sddoctor to resume it",
        )
    files, saved_ranks, step = meta.get("files"), meta.get("world_size"), meta.get("step")
    if not isinstance(files, dict) or not _count(saved_ranks, 1) or not _count(step, 0):
        return Verdict(DAMAGED, "meta.json lacks the file list, the world size or the step")
    missing = missing_ranks(path, saved_ranks)
    if not reshard and saved_ranks != world_size:
        return Verdict(
            REFUSED,
            f"checkpoint {path} was saved by {saved_ranks} ranks and this run has {world_size}: launch "
            f"{saved_ranks} ranks to resume exactly, or add --set checkpoint.reshard=true to continue on "
            f"{world_size} (weights, optimizer, LR schedule and data position carry over; the random "
            "streams restart, so losses will not repeat an uninterrupted run)",
        )
    if not reshard and missing:
        names = ", ".join(f"{rank_name(r)}.json/.safetensors" for r in missing)
        return Verdict(
            REFUSED,
            f"checkpoint {path} lacks {names} (the state of rank(s) {missing}): copy the missing files "
            "from where the checkpoint was written, resume an earlier checkpoint with --resume PATH, "
            "or add --set checkpoint.reshard=true to continue without the per-rank random states",
        )
    per_rank = saved_ranks == world_size and not missing
    for stem in ["state"] + ([rank_name(rank)] if per_rank else []):
        problem = _verify_part(path, stem, files.get(f"{stem}.json"))
        if problem:
            return Verdict(DAMAGED, problem)
    return Verdict(OK, step=step, saved_ranks=saved_ranks, per_rank=per_rank)


def _count(value: Any, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _verify_part(path: Path, stem: str, expected: Any) -> str | None:
    problem = check_digest(path / f"{stem}.json", expected)
    if problem:
        return problem
    try:
        tensors = read_json(path / f"{stem}.json")["tensors"]
        if tensors["file"] != f"{stem}.safetensors":
            return f"{stem}.json names another tensor file ({tensors['file']!r})"
    except (StateFormatError, KeyError, TypeError) as exc:
        return f"{stem}.json is malformed ({exc})"
    return check_digest(path / f"{stem}.safetensors", tensors)


def choose_checkpoint(
    resume: str,
    root: Path,
    rank: int,
    world_size: int,
    reshard: bool,
    gather: Callable[[Any], list[Any]],
    warn: Callable[[str], None],
) -> Resume | None:
    """The checkpoint every rank resumes from, verified; None to start fresh.

    `resume` is '' (no resume), 'latest' (newest intact checkpoint under `root`, falling back past
    damaged ones, each reported through `warn`) or a checkpoint folder (used as is or refused).
    `gather(obj)` returns every rank's obj (all ranks call this together). CheckpointError when the
    run must not start: refused, damaged explicit path, or no intact checkpoint left.
    """
    if not resume:
        return None
    if resume == "latest":
        candidates = [p for _, p in reversed(list_checkpoints(root))]
        if not candidates:
            return None
    else:
        path = Path(resume)
        if not (path / "meta.json").is_file():
            hint = f"; complete checkpoints under {root}: {[p.name for _, p in list_checkpoints(root)]}"
            raise CheckpointError(f"--resume {resume}: not a complete checkpoint folder (no meta.json){hint}")
        candidates = [path]
    damaged: list[str] = []
    for path in candidates:
        verdicts = gather(inspect_checkpoint(path, rank, world_size, reshard))
        refused = [v for v in verdicts if v.kind == REFUSED]
        if refused:
            raise CheckpointError(refused[0].reason)
        bad = [(r, v) for r, v in enumerate(verdicts) if v.kind == DAMAGED]
        if not bad:
            found = verdicts[0]  # rank 0's reading; every rank found the checkpoint intact
            per_rank = all(v.per_rank for v in verdicts)
            return Resume(path, found.step, found.saved_ranks, per_rank)
        r, verdict = bad[0]
        where = f"rank {r}: " if world_size > 1 else ""
        line = f"checkpoint {path} is damaged ({where}{verdict.reason})"
        if resume != "latest":
            intact = [p.name for _, p in list_checkpoints(root) if p != path]
            raise CheckpointError(
                f"{line}; resume another one with --resume PATH (others under {root}: {intact})"
            )
        damaged.append(line)
        warn(f"{line}; falling back to the previous checkpoint")
    raise CheckpointError(
        f"no intact checkpoint under {root}: "
        + "; ".join(damaged)
        + ". Move the damaged folders away to start from scratch"
    )


def load_checkpoint(
    resume: Resume, rank: int
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(shared state, this rank's state or None when re-sharding, meta) of a verified checkpoint."""
    path = resume.path
    try:
        meta = _meta(path)
        shared = _read_part(path, "state")
        per_rank = _read_part(path, rank_name(rank)) if resume.per_rank else None
    except StateFormatError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(shared, dict) or (per_rank is not None and not isinstance(per_rank, dict)):
        raise CheckpointError(f"cannot read checkpoint {path}: its state is not a JSON object")
    return shared, per_rank, meta


def _read_part(path: Path, stem: str) -> Any:
    part = read_json(path / f"{stem}.json")
    if not isinstance(part, dict) or not isinstance(part.get("tensors"), dict):
        raise StateFormatError(f"{stem}.json is malformed")
    return decode(part.get("tree"), read_safetensors(path / f"{stem}.safetensors"))


# -- converting the earlier pickle format ---------------------------------------------------


def convert_old_checkpoint(path: Path) -> Path:
    """Rewrite a pickle checkpoint (state.pt, rank-N.pt) in this format, in place.

    Reads with `torch.load(weights_only=True)` only, which refuses any pickle that names code
    (numpy's array reconstruction is the one extra allowed, for the RNG states); torch older than
    2.6 is refused, since its weights_only loader could be bypassed (CVE-2025-32434). The .pt
    files are left in place; meta.json is replaced last, so an interrupted conversion changes nothing.
    """
    if not old_format(path):
        raise CheckpointError(
            f"{path} is not a checkpoint in the earlier format (no state.pt without state.json)"
        )
    major_minor = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    if major_minor < (2, 6):
        raise CheckpointError(
            f"converting needs torch >= 2.6 (this is {torch.__version__}): older weights_only loading "
            "is not safe against crafted files"
        )
    old_meta = _meta(path)
    world_size = int(old_meta.get("world_size", 1))
    state = _load_weights_only(path / "state.pt")
    tmp = path / ".converting"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {"state.json": _write_part(tmp, "state", state)}
    for r in range(world_size):
        old_rank = path / f"{rank_name(r)}.pt"
        if old_rank.is_file():
            rank_state = _load_weights_only(old_rank)
            rank_state["rng"] = _convert_old_rng(rank_state.get("rng", {}))
            files[f"{rank_name(r)}.json"] = _write_part(tmp, rank_name(r), rank_state)
    for entry in tmp.iterdir():
        os.replace(entry, path / entry.name)
    tmp.rmdir()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(old_meta.get("step", state.get("step", 0))),
        "world_size": world_size,
        "time": old_meta.get("time", time.time()),
        "versions": versions(),
        "files": files,
        "converted_from": "state.pt",
    }
    meta_tmp = path / ".meta.json.tmp"
    write_json(meta_tmp, meta)
    os.replace(meta_tmp, path / "meta.json")
    _fsync_dir(path)
    return path


def _load_weights_only(path: Path) -> dict[str, Any]:
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]
    core = getattr(np, "_core", None) or np.core
    allowed.append(core.multiarray._reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler refuses with many error types
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"{path} cannot be read with weights_only=True, so it is not converted ({type(exc).__name__}"
            f"{': ' + first[-1][:200] if first else ''})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return state


def _convert_old_rng(old: dict[str, Any]) -> dict[str, Any]:
    """The earlier rank files' RNG states (tuples and numpy arrays) as rng_state() returns them."""
    try:
        version, mt, gauss = old["python"]
        algorithm, key, pos, has_gauss, cached = old["numpy"]
        new = {
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "algorithm": algorithm,
                "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": old["torch"],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the earlier rank file's RNG state is not understood ({exc})") from None
    for key in ("cuda", "generator"):
        if key in old:
            new[key] = old[key]
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.checkpoint", description="Trainer checkpoint tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert", help="rewrite an earlier pickle checkpoint (state.pt) as safetensors + JSON, in place"
    )
    convert.add_argument("path", type=Path)
    verify = commands.add_parser("verify", help="check every file of a checkpoint against its checksums")
    verify.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            convert_old_checkpoint(args.path)
            print(f"converted {args.path}; the .pt files are no longer read and can be deleted")
            return 0
        return _verify_command(args.path)
    except CheckpointError as exc:
        print(f"trainer.checkpoint: error: {exc}", file=sys.stderr)
        return 2


def _verify_command(path: Path) -> int:
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint folder (no meta.json)")
    meta = _meta(path) if not old_format(path) else {}
    saved_ranks = int(meta.get("world_size", 1)) if isinstance(meta.get("world_size"), int) else 1
    problems = []
    for r in range(saved_ranks):
        verdict = inspect_checkpoint(path, r, saved_ranks, reshard=False)
        if verdict.kind != OK and verdict.reason not in problems:
            problems.append(verdict.reason)
    if problems:
        raise CheckpointError("; ".join(problems))
    print(f"{path}: intact (step {meta['step']}, {saved_ranks} rank(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
