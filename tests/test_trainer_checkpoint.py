"""Checkpoint files: safetensors + JSON round trips, verification, fallback, and no code ever run.

The pickle tests build real payloads (a `__reduce__` that creates a marker file), first prove
that unpickling them does run the payload, then show that resuming, verifying and converting
refuse them without running it. Multi-rank refusals (a missing rank file, another world size)
and the fallback inside a real resumed run are in tests/test_trainer_run.py.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, run_to_end, subprocess_env
from trainer.checkpoint import (
    CheckpointError,
    Resume,
    choose_checkpoint,
    convert_old_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.safe_state import decode, encode, file_digest, read_safetensors, write_safetensors


def one_rank(obj):
    return [obj]


def adam_state() -> dict:
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.99))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer.state_dict()


def shared(step: int, marker: float = 1.0) -> dict:
    return {
        "step": step,
        "unet": {"conv.weight": torch.full((2, 2), marker), "flag": torch.tensor([True, False])},
        "optimizer": adam_state(),
        "scale": float("inf"),
        "samplers": [{"epoch": 0, "position": step}],
        "__tensor__": "a key that looks like a tag",
    }


def save(root: Path, step: int, world_size: int = 1, **kwargs) -> Path:
    """Every rank's part of save_checkpoint, ranks as threads meeting at a real barrier."""
    barrier = threading.Barrier(world_size, timeout=60)
    paths: list[Path] = []

    def rank_writes(rank: int) -> None:
        generator = torch.Generator().manual_seed(step * 10 + rank)
        paths.append(
            save_checkpoint(
                root,
                step,
                lambda: shared(step, marker=float(step)),
                {"rng": rng_state(generator), "sampler": {"position": step}},
                rank,
                world_size,
                barrier.wait,
                **kwargs,
            )
        )

    threads = [threading.Thread(target=rank_writes, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == world_size and len(set(paths)) == 1
    return paths[0]


def test_tree_round_trip_keeps_types_tags_and_bits(tmp_path):
    state = shared(3)
    tree, tensors = encode(state)
    json.dumps(tree, allow_nan=False)  # plain JSON: no NaN/inf literals, no objects
    info = write_safetensors(tmp_path / "t.safetensors", tensors)
    assert info == file_digest(tmp_path / "t.safetensors")
    back = decode(json.loads(json.dumps(tree)), read_safetensors(tmp_path / "t.safetensors"))
    assert back["step"] == 3 and back["scale"] == float("inf") and back["__tensor__"] == state["__tensor__"]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.99)  # a tuple again
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys again: Optimizer.load_state_dict needs them
    for key, value in state["optimizer"]["state"][1].items():
        assert (
            torch.equal(back["optimizer"]["state"][1][key], value)
            and back["optimizer"]["state"][1][key].dtype == value.dtype
        )
    assert torch.equal(back["unet"]["flag"], state["unet"]["flag"])
    # the tensor file reads on its own, with names a person can follow
    assert "unet/conv.weight" in tensors and "optimizer/state/0/exp_avg" in tensors


def test_unsupported_values_fail_at_save_not_at_resume():
    with pytest.raises(TypeError, match="ndarray"):
        encode({"x": np.zeros(3)})


def test_rng_states_restore_exactly():
    generator = torch.Generator().manual_seed(5)
    random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=generator)
    tree, tensors = encode(rng_state(generator))
    expected = (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(2).tolist(),
        torch.rand(2, generator=generator).tolist(),
    )
    random.seed(0), np.random.seed(0), torch.manual_seed(0), generator.manual_seed(0)
    set_rng_state(decode(json.loads(json.dumps(tree)), tensors), generator)
    again = (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(2).tolist(),
        torch.rand(2, generator=generator).tolist(),
    )
    assert again == expected


def test_save_load_and_pruning(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        save(root, step, keep=2)
    assert [s for s, _ in list_checkpoints(root)] == [10, 15]
    files = sorted(p.name for p in (root / "step-00000015").iterdir())
    assert files == [
        "meta.json",
        "rank-00000.json",
        "rank-00000.safetensors",
        "state.json",
        "state.safetensors",
    ]
    assert not list((root / "step-00000015").glob("*.pt"))
    resume = choose_checkpoint("latest", root, 0, 1, False, one_rank, print)
    assert resume == Resume(root / "step-00000015", 15, 1, True)
    state, rank_state, meta = load_checkpoint(resume, 0)
    assert state["step"] == 15 and torch.equal(state["unet"]["conv.weight"], torch.full((2, 2), 15.0))
    assert rank_state is not None and rank_state["sampler"] == {"position": 15}
    assert meta["versions"]["torch"] == torch.__version__
    assert choose_checkpoint("", root, 0, 1, False, one_rank, print) is None
    assert choose_checkpoint("latest", tmp_path / "none", 0, 1, False, one_rank, print) is None


def test_interrupted_save_leaves_the_last_checkpoint_intact(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 5, lambda: {"w": 1}, {"rng": 0}, 0, 1, lambda: None)

    def dies_while_writing() -> dict:
        raise KeyboardInterrupt  # stands in for a kill in the middle of writing the shared state

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 10, dies_while_writing, {"rng": 0}, 0, 1, lambda: None)
    assert [s for s, _ in list_checkpoints(root)] == [5]
    assert (root / ".tmp-step-00000010").is_dir()  # the partial one is never taken for a checkpoint
    save_checkpoint(root, 10, lambda: {"w": 2}, {"rng": 0}, 0, 1, lambda: None, keep=1)
    assert [s for s, _ in list_checkpoints(root)] == [10]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: truncate(p / "state.safetensors"), "state.safetensors has"),
        (lambda p: flip_a_byte(p / "state.safetensors"), "state.safetensors does not match its sha256"),
        (lambda p: flip_a_byte(p / "rank-00000.safetensors"), "rank-00000.safetensors does not match"),
        (lambda p: (p / "state.safetensors").unlink(), "state.safetensors is missing"),
        (lambda p: (p / "state.json").write_text("{"), "state.json has"),
        (lambda p: (p / "meta.json").write_text("{not json"), "meta.json is not valid JSON"),
        (
            lambda p: (p / "meta.json").write_text('{"format": "sddoctor-trainer-checkpoint", "version": 2}'),
            "lacks",
        ),
    ],
)
def test_damaged_newest_falls_back_in_one_line_and_explicit_path_is_refused(tmp_path, damage, reason):
    root = tmp_path / "checkpoints"
    save(root, 10)
    newest = save(root, 20)
    damage(newest)
    lines: list[str] = []
    resume = choose_checkpoint("latest", root, 0, 1, False, one_rank, lines.append)
    assert resume is not None and resume.step == 10
    assert len(lines) == 1 and str(newest) in lines[0] and reason in lines[0] and "\n" not in lines[0]
    with pytest.raises(CheckpointError, match="is damaged") as info:
        choose_checkpoint(str(newest), root, 0, 1, False, one_rank, lines.append)
    assert reason in str(info.value) and "step-00000010" in str(info.value)


def test_no_intact_checkpoint_left_stops_instead_of_starting_over(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        flip_a_byte(save(root, step) / "state.safetensors")
    with pytest.raises(CheckpointError, match="no intact checkpoint under") as info:
        choose_checkpoint("latest", root, 0, 1, False, one_rank, lambda line: None)
    assert "step-00000010" in str(info.value) and "step-00000020" in str(info.value)


def test_world_size_and_missing_rank_file_are_refused_unless_resharding(tmp_path):
    root = tmp_path / "checkpoints"
    path = save(root, 10, world_size=2)
    with pytest.raises(CheckpointError, match="saved by 2 ranks and this run has 1") as info:
        choose_checkpoint("latest", root, 0, 1, False, one_rank, print)
    assert "checkpoint.reshard=true" in str(info.value)
    resharded = choose_checkpoint("latest", root, 0, 1, True, one_rank, print)
    assert resharded == Resume(path, 10, 2, False)
    shared_state, rank_state, _ = load_checkpoint(resharded, 0)
    assert rank_state is None and shared_state["step"] == 10

    (path / "rank-00001.safetensors").unlink()
    verdicts = []

    def two_ranks(obj):  # what rank 0 and rank 1 of a 2-rank run each find
        from trainer.checkpoint import inspect_checkpoint

        verdicts[:] = [obj, inspect_checkpoint(path, 1, 2, False)]
        return verdicts

    with pytest.raises(
        CheckpointError, match=r"lacks rank-00001.json/.safetensors \(the state of rank\(s\) \[1\]\)"
    ):
        choose_checkpoint("latest", root, 0, 2, False, two_ranks, print)
    assert choose_checkpoint("latest", root, 0, 2, True, one_rank, print).per_rank is False


# -- pickles -------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates the marker file: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def payload_bytes(marker: Path) -> bytes:
    data = pickle.dumps({"step": 1, "unet": Payload(marker)})
    pickle.loads(data)  # the payload is real: unpickling runs it
    assert marker.exists()
    marker.unlink()
    return data


def old_format_checkpoint(root: Path, marker: Path) -> Path:
    """The earlier layout, written as the earlier trainer did (torch.save), carrying the payload."""
    path = root / "step-00000010"
    path.mkdir(parents=True)
    for name in ("state.pt", "rank-00000.pt"):
        torch.save({"step": 10, "unet": Payload(marker)}, path / name)
        torch.load(path / name, weights_only=False)  # the payload is real: the earlier loader ran it
        assert marker.exists()
        marker.unlink()
    (path / "meta.json").write_text(json.dumps({"step": 10, "world_size": 1, "time": 0}))
    return path


def test_old_pickle_checkpoint_is_refused_with_the_fix_and_never_unpickled(tmp_path):
    marker = tmp_path / "payload-ran"
    path = old_format_checkpoint(tmp_path / "checkpoints", marker)
    for resume in ("latest", str(path)):
        with pytest.raises(CheckpointError, match="earlier pickle format") as info:
            choose_checkpoint(resume, tmp_path / "checkpoints", 0, 1, False, one_rank, print)
        assert f"python -m trainer.checkpoint convert {path}" in str(info.value)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        convert_old_checkpoint(path)  # the converter's weights_only loader refuses the payload
    assert not marker.exists()
    assert not (path / "state.json").exists()


def test_pickle_disguised_as_safetensors_with_valid_checksums_is_refused(tmp_path):
    """A crafted checkpoint: the checksums are right, the tensor file is a pickle."""
    marker = tmp_path / "payload-ran"
    root = tmp_path / "checkpoints"
    path = save(root, 10)
    (path / "state.safetensors").write_bytes(payload_bytes(marker))
    part = json.loads((path / "state.json").read_text())
    part["tensors"].update(file_digest(path / "state.safetensors"))
    (path / "state.json").write_text(json.dumps(part))
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["state.json"] = file_digest(path / "state.json")
    (path / "meta.json").write_text(json.dumps(meta))
    resume = choose_checkpoint(str(path), root, 0, 1, False, one_rank, print)  # checksums pass
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_checkpoint(resume, 0)
    assert not marker.exists()


def test_trainer_refuses_a_pickle_checkpoint_with_exit_2_and_no_payload(tmp_path):
    marker = tmp_path / "payload-ran"
    path = old_format_checkpoint(tmp_path / "out" / "checkpoints", marker)
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--output-dir", str(tmp_path / "out"), "--resume", str(path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert (
        "earlier pickle format" in result.stderr and "python -m trainer.checkpoint convert" in result.stderr
    )
    assert not marker.exists()


def test_converting_an_earlier_checkpoint_keeps_every_value(tmp_path):
    """What the earlier trainer wrote with torch.save: tensors, tuples, numpy RNG state."""
    path = tmp_path / "checkpoints" / "step-00000007"
    path.mkdir(parents=True)
    old_shared = shared(7)
    del old_shared["scale"]
    torch.save(old_shared, path / "state.pt")
    generator = torch.Generator().manual_seed(3)
    old_rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    torch.save({"rng": old_rng, "sampler": {"position": 7}, "step": 7}, path / "rank-00000.pt")
    (path / "meta.json").write_text(json.dumps({"step": 7, "world_size": 1, "time": 0}))
    code, output = run_to_end([sys.executable, "-m", "trainer.checkpoint", "convert", str(path)], timeout=120)
    assert code == 0, output
    resume = choose_checkpoint("latest", tmp_path / "checkpoints", 0, 1, False, one_rank, print)
    state, rank_state, _ = load_checkpoint(resume, 0)
    assert torch.equal(state["unet"]["conv.weight"], old_shared["unet"]["conv.weight"])
    assert state["optimizer"]["param_groups"] == old_shared["optimizer"]["param_groups"]
    expected = (random.random(), np.random.rand(2).tolist(), torch.rand(2, generator=generator).tolist())
    other = torch.Generator()
    set_rng_state(rank_state["rng"], other)
    assert (random.random(), np.random.rand(2).tolist(), torch.rand(2, generator=other).tolist()) == expected
    code, output = run_to_end([sys.executable, "-m", "trainer.checkpoint", "verify", str(path)], timeout=120)
    assert code == 0 and "intact (step 7" in output, output
    shutil.rmtree(path)


def test_a_checkpoint_of_another_model_is_bad_input_not_a_crash(tmp_path):
    from trainer.checkpointer import checkpoint_must_fit

    with pytest.raises(
        CheckpointError, match="does not fit this run .*size mismatch.*resume it with the preset"
    ):
        with checkpoint_must_fit(tmp_path):
            torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)})
