"""Real 2-rank CPU runs of the trainer (torchrun, gloo) on a small tiny-preset config.

One reference run is checked for a falling loss, identical weights on both ranks, telemetry,
TensorBoard's curves and sample grid (read back with TensorBoard's reader), and an export that StableDiffusionPipeline loads (folder and single file, every tensor equal to
the trainer's) and samples from. A second run is stopped with SIGTERM, saves a checkpoint, and
is resumed: its per-step losses must equal the reference's exactly; then its newest checkpoint
is damaged and `--resume latest` falls back to the previous one, again repeating the losses.
The reference's checkpoint is refused on another world size or without a rank's files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_to_end, start_in_session, subprocess_env, wait_to_end
from export_check import PROMPTS
from sddoctor.telemetry.reader import read_events
from trainer.checkpoint import choose_checkpoint, list_checkpoints, load_checkpoint

MAX_STEPS = 20

SMALL = [
    "--set",
    "model.vae_warmup_steps=10",
    "data.max_samples=128",
    f"train.max_steps={MAX_STEPS}",
    "train.micro_batch=8",
    "train.grad_accum=2",
    "train.log_every=5",
    "train.ema_decay=0.9",
    "optim.warmup_steps=5",
    "sample.prompts=a handwritten digit one;a handwritten digit seven",
    "sample.images_per_prompt=2",
    "sample.steps=3",
]


def launch(out: Path, cache: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "trainer", "--output-dir", str(out), *SMALL, f"data.cache_dir={cache}", *extra]
    return start_in_session(cmd)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    return wait_to_end(proc, timeout=240)


def step_losses(out: Path, rank: int) -> dict[int, float]:
    """step -> loss; a step recorded twice (before a stop and again after resuming) keeps the last."""
    events = read_events(out / "ranks" / f"rank-{rank:05d}.jsonl", kinds={"step"})
    return {e["step"]: e["loss"] for e in events}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    out = tmp_path_factory.mktemp("reference")
    code, output = finish(launch(out, cache))
    assert code == 0, output[-4000:]
    return out


def test_loss_falls_and_ranks_stay_identical(reference):
    for rank in (0, 1):
        losses = step_losses(reference, rank)
        assert sorted(losses) == list(range(1, MAX_STEPS + 1))
        first = sum(losses[s] for s in range(1, 5)) / 4
        last = sum(losses[s] for s in range(MAX_STEPS - 3, MAX_STEPS + 1)) / 4
        assert last < 0.8 * first, (first, last)
    digests = [read_events(reference / "ranks" / f"rank-{r:05d}.jsonl", kinds={"replicas"}) for r in (0, 1)]
    assert digests[0][-1]["params_sha256"] == digests[1][-1]["params_sha256"]
    warnings = read_events(reference / "ranks" / "rank-00000.jsonl", kinds={"warning"})
    assert not [w for w in warnings if w.get("code") == "replicas_differ"]


def test_telemetry_and_outputs(reference):
    run = json.loads((reference / "run.json").read_text())
    assert run["world_size"] == 2 and run["backend"] == "gloo"
    events = read_events(reference / "ranks" / "rank-00001.jsonl")
    start, last_step, exit_ = events[0], [e for e in events if e["kind"] == "step"][-1], events[-1]
    assert start["kind"] == "start" and start["backend"] == "gloo" and start["world_size"] == 2
    assert last_step["micro_batch"] == 8 and last_step["grad_accum"] == 2 and last_step["samples"] == 16
    assert last_step["step_time"] > 0 and last_step["lr"] > 0
    assert exit_["kind"] == "exit" and exit_["status"] == "ok" and exit_["code"] == 0
    assert (reference / "samples" / f"step-{MAX_STEPS:08d}.png").is_file()
    assert [s for s, _ in list_checkpoints(reference / "checkpoints")] == [MAX_STEPS]


def test_export_loads_in_diffusers_and_samples(reference):
    import numpy as np
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(reference / "export")
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a handwritten digit one", num_inference_steps=2, height=32, width=32, output_type="np"
    ).images
    assert image.shape == (1, 32, 32, 3)
    assert np.isfinite(image).all() and image.std() > 0


def test_tensorboard_holds_the_curves_and_the_sample_grid(reference):
    """Read back with TensorBoard's own reader: the interval's loss is the mean over both ranks and
    its steps, the learning rate is the steps', and the sample grid is the saved PNG."""
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/images_per_s",
        "perf/images_per_s_per_gpu",
        "perf/step_time_s",
        "perf/data_wait_s",
        "memory/current_gib",
        "memory/peak_gib",
        "oom/fallbacks",
        "oom/micro_batch",
    } <= set(events.Tags()["scalars"])
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(losses) == [5, 10, 15, 20]
    per_rank = [step_losses(reference, rank) for rank in (0, 1)]
    for end, value in losses.items():
        mean = sum(steps[s] for steps in per_rank for s in range(end - 4, end + 1)) / 10
        assert value == pytest.approx(mean, rel=1e-5), (end, value, mean)
    lrs = {e["step"]: e["lr"] for e in read_events(reference / "ranks" / "rank-00000.jsonl", kinds={"step"})}
    assert all(e.value == pytest.approx(lrs[e.step], rel=1e-6) for e in events.Scalars("train/lr"))
    for tag in ("train/grad_norm", "perf/images_per_s", "perf/step_time_s", "memory/current_gib"):
        assert all(0 < e.value < float("inf") for e in events.Scalars(tag)), tag
    assert [e.value for e in events.Scalars("oom/fallbacks")] == [0, 0, 0, 0]
    (grid,) = events.Images("samples")
    saved = Image.open(reference / "samples" / f"step-{MAX_STEPS:08d}.png")
    assert grid.step == MAX_STEPS and (grid.width, grid.height) == saved.size
    assert (
        Image.open(io.BytesIO(grid.encoded_image_string)).convert("RGB").tobytes()
        == saved.convert("RGB").tobytes()
    )


def test_sigterm_checkpoints_and_resume_repeats_the_losses(reference, cache, tmp_path):
    out = tmp_path / "stopped"
    proc = launch(out, cache)
    events_file = out / "ranks" / "rank-00000.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if events_file.exists() and max(step_losses(out, 0) or {0: 0}) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
    code, output = finish(proc)
    saved = list_checkpoints(out / "checkpoints")
    assert len(saved) == 1, output[-4000:]
    stopped_at = saved[0][0]
    assert 0 < stopped_at < MAX_STEPS and stopped_at % 5 == 0, output[-3000:]
    ckpt_events = read_events(events_file, kinds={"checkpoint"})
    assert ckpt_events[-1]["reason"] == "signal SIGTERM" and ckpt_events[-1]["step"] == stopped_at

    code, output = finish(launch(out, cache, "--resume", "latest"))
    assert code == 0, output[-4000:]
    assert f"resumed from {saved[0][1]} at step {stopped_at}" in output
    for rank in (0, 1):
        assert step_losses(out, rank) == step_losses(reference, rank)

    # A damaged newest checkpoint: one line, then the previous one, and still the same losses.
    newest = out / "checkpoints" / f"step-{MAX_STEPS:08d}"
    data = bytearray((newest / "state.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "state.safetensors").write_bytes(bytes(data))
    for rank in (0, 1):
        (out / "ranks" / f"rank-{rank:05d}.jsonl").unlink()
    code, output = finish(launch(out, cache, "--resume", "latest"))
    assert code == 0, output[-4000:]
    damaged = [line for line in output.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and "state.safetensors does not match its sha256" in damaged[0], output[-3000:]
    assert f"resumed from {saved[0][1]} at step {stopped_at}" in output
    for rank in (0, 1):
        resumed = step_losses(out, rank)
        assert min(resumed) == stopped_at + 1
        assert resumed == {s: v for s, v in step_losses(reference, rank).items() if s > stopped_at}


def run_one_rank(out: Path, cache: Path, *extra: str) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--output-dir",
        str(out),
        *SMALL,
        f"data.cache_dir={cache}",
        *extra,
    ]
    return run_to_end(cmd, timeout=240, env=subprocess_env(SDDOCTOR_PREFLIGHT="0"))


def test_another_world_size_or_a_missing_rank_file_is_refused_or_resharded(reference, cache, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    code, output = run_one_rank(out, cache, "--resume", "latest")
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert "was saved by 2 ranks and this run has 1" in output and "checkpoint.reshard=true" in output

    code, output = run_one_rank(
        out, cache, "--resume", "latest", "--set", "checkpoint.reshard=true", "train.max_steps=22"
    )
    assert code == 0, output[-3000:]
    assert "re-sharding" in output and f"resumed from {out / 'checkpoints'}" in output
    assert sorted(step_losses(out, 0)) == [21, 22]

    out = tmp_path / "missing"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / f"step-{MAX_STEPS:08d}" / "rank-00001.safetensors").unlink()
    code, output = finish(launch(out, cache, "--resume", "latest", "--set", "train.max_steps=22"))
    assert code != 0, output[-3000:]
    assert "lacks rank-00001.json/.safetensors" in output and "checkpoint.reshard=true" in output
    assert f'File "{REPO_ROOT / "trainer"}' not in output  # a refusal, not a crash
    assert not step_losses(out, 0)


def reference_weights(reference: Path) -> dict:
    """The trainer's final weights from its checkpoint: the EMA UNet (what the export writes), VAE, text encoder."""
    from trainer.models import build_models

    resume = choose_checkpoint("latest", reference / "checkpoints", 0, 2, False, lambda v: [v, v], print)
    state, _, _ = load_checkpoint(resume, 0)
    unet = dict(state["unet"])
    names = [n for n, p in build_models("tiny").unet.named_parameters() if p.requires_grad]
    unet.update(zip(names, state["ema"]["shadow"], strict=True))
    weights = {f"unet/{k}": v for k, v in unet.items()}
    weights.update({f"vae/{k}": v for k, v in state["vae"].items()})
    weights.update({f"text_encoder/{k}": v for k, v in state["text_encoder"].items()})
    return {
        "weights": {k: v.contiguous() for k, v in weights.items()},
        "scaling": state["vae_scaling_factor"],
    }


INTERPRETERS = [sys.executable] + list(filter(None, [os.environ.get("SDDOCTOR_HF_OLDEST_PYTHON")]))


@pytest.mark.parametrize("python", INTERPRETERS, ids=["installed", "oldest"][: len(INTERPRETERS)])
def test_export_holds_the_trained_weights_for_every_loader(reference, tmp_path, python):
    """from_pretrained and from_single_file (configs only, offline) give back every trained tensor."""
    from safetensors.torch import save_file

    from trainer.models import build_tokenizer

    trained = reference_weights(reference)
    save_file(trained["weights"], tmp_path / "trained.safetensors")
    export = reference / "export"
    assert sorted(p.name for p in (export / "tokenizer").iterdir()) == [
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    result = subprocess.run(
        [
            python,
            str(REPO_ROOT / "tests" / "export_check.py"),
            str(export),
            str(tmp_path / "trained.safetensors"),
            str(export / "tiny.safetensors"),
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["from_pretrained"] == [] and report["from_single_file"] == [], report
    assert result.returncode == 0
    assert report["scaling_factor"] == report["single_file_scaling_factor"] == trained["scaling"]
    tokenizer = build_tokenizer(model_max_length=16)
    assert report["token_ids"] == [tokenizer(p).input_ids for p in PROMPTS]
