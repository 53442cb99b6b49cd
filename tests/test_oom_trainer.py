"""The bundled trainer under injected out-of-memory: 2 real gloo ranks (torchrun), tiny preset.

One run takes a backward OOM on rank 1 after bucket 0 was sent (step 2), a forward OOM on every
rank (step 4) and an OOM on rank 0 right after its optimizer updated the weights (step 5, EMA
on): every rank must fall back together (8x1 -> 4x2 -> 2x4 -> 1x8), finish, and end with
identical weights and learning rates (rank 0's skipped scheduler step is copied from rank 1).
A second run resumes its last checkpoint and must keep micro-batch 1.
The trainer runs with telemetry on, so DDP is built under the bootstrap's ddp_patch and the
guard's hook feeds `collectives.ddp` in the state snapshot.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_to_end, subprocess_env
from sddoctor.telemetry.reader import read_events
from trainer.checkpoint import list_checkpoints
from trainer.config import build_config
from trainer.train import Dist, Trainer

FAULTS = "oom:rank=1,step=2,phase=backward,bucket=1;oom:rank=*,step=4,phase=forward;oom:rank=0,step=5,phase=optimizer"
ARGS = [
    "--set",
    "model.vae_warmup_steps=2",
    "data.max_samples=64",
    "train.micro_batch=8",
    "train.grad_accum=1",
    "train.log_every=3",
    "train.ema_decay=0.9",
    "ddp.bucket_cap_mb=1",  # several gradient buckets, so that bucket 1 exists
    "sample.at_end=false",
    "output.export=false",
]


def train(out: Path, cache: Path, max_steps: int, *extra: str, fault: str = "") -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "trainer", "--output-dir", str(out), *ARGS, f"data.cache_dir={cache}"]
    cmd += [f"train.max_steps={max_steps}", *extra]
    code, output = run_to_end(cmd, timeout=240, env=subprocess_env(SDDOCTOR_FAULT=fault))
    assert code == 0, output[-4000:]
    return output


def events(out: Path, rank: int, kind: str) -> list[dict]:
    return read_events(out / "ranks" / f"rank-{rank:05d}.jsonl", kinds={kind})


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> tuple[Path, Path, str]:
    out = tmp_path_factory.mktemp("faulted")
    cache = tmp_path_factory.mktemp("cache")
    return out, cache, train(out, cache, 6, fault=FAULTS)


def test_ooms_in_backward_on_one_rank_and_forward_on_all_fall_back_together(faulted) -> None:
    out, _, output = faulted
    # step 5's optimizer failure is known at step 6's agreement: step 5 stays applied (from rank 1)
    expected = {1: (8, 1), 2: (4, 2), 3: (4, 2), 4: (2, 4), 5: (2, 4), 6: (1, 8)}
    for rank in (0, 1):
        steps = {e["step"]: (e["micro_batch"], e["grad_accum"]) for e in events(out, rank, "step")}
        assert steps == expected, (rank, steps)
        fallbacks = [
            (e["step"], e["new_micro_batch"], e["failed_ranks"], e["step_applied"])
            for e in events(out, rank, "fallback")
        ]
        assert fallbacks == [(2, 4, [1], False), (4, 2, [0, 1], False), (5, 1, [0], True)], (rank, fallbacks)
    assert [(e["step"], e["phase"]) for e in events(out, 1, "oom")] == [(2, "backward"), (4, "forward")]
    assert [(e["step"], e["phase"]) for e in events(out, 0, "oom")] == [(4, "forward"), (5, "optimizer")]
    lrs = [[e["lr"] for e in events(out, rank, "step")] for rank in (0, 1)]
    assert lrs[0] == lrs[1]
    digests = [events(out, rank, "replicas")[-1]["params_sha256"] for rank in (0, 1)]
    assert digests[0] == digests[1]
    assert "OOM guard: out of memory in backward on rank(s) [1] at step 2" in output
    assert "runs micro-batch 2 x 4 accumulation" in output
    assert "the failed optimizer step was completed from a healthy rank" in output
    # DDP was built under the bootstrap's patch; the guard's hook counted the gradient buckets.
    state = json.loads((out / "ranks" / "rank-00000.state").read_text())
    assert state["collectives"]["ddp"]["buckets"] > 6


def test_resume_after_a_fallback_keeps_the_smaller_micro_batch(faulted) -> None:
    out, cache, _ = faulted
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [6]
    output = train(out, cache, 8, "--resume", "latest")
    assert "micro-batch 1 x 8 accumulation, from the checkpoint" in output
    for rank in (0, 1):
        steps = {e["step"]: (e["micro_batch"], e["grad_accum"]) for e in events(out, rank, "step")}
        assert steps[7] == steps[8] == (1, 8)
    digests = [events(out, rank, "replicas")[-1]["params_sha256"] for rank in (0, 1)]
    assert digests[0] == digests[1]


def test_fallback_recompiles_a_compiled_unet(tmp_path) -> None:
    """torch.compile (on by default on CUDA in the SD presets) under the guard: each fallback
    re-wraps DDP and changes the micro-batch shape, so the compiled UNet is traced again. The
    aot_eager backend runs the same graph capture without generating kernels (fast on a CPU)."""
    out = tmp_path / "compiled"
    faults = "oom:rank=1,step=2,phase=backward;oom:rank=*,step=4,phase=forward"
    output = train(
        out, tmp_path / "cache", 5, "model.compile=true", "model.compile_backend=aot_eager", fault=faults
    )
    assert "compiling the UNet with torch.compile" in output
    for rank in (0, 1):
        steps = {e["step"]: (e["micro_batch"], e["grad_accum"]) for e in events(out, rank, "step")}
        assert steps == {1: (8, 1), 2: (4, 2), 3: (4, 2), 4: (2, 4), 5: (2, 4)}, (rank, steps)
    digests = [events(out, rank, "replicas")[-1]["params_sha256"] for rank in (0, 1)]
    assert digests[0] == digests[1]


def test_find_unused_parameters_turns_the_guard_off_with_a_warning(capsys) -> None:
    trainer = Trainer(build_config("tiny", None, ["ddp.find_unused_parameters=true"]))
    trainer.dist = Dist(rank=0, local_rank=0, world_size=2, device=None, backend="gloo")  # type: ignore[arg-type]
    assert trainer.build_guard(None, None, None, None, [], False) is None  # type: ignore[arg-type]
    assert "OOM guard off" in capsys.readouterr().out


# -- the guard's per-step overhead on the tiny trainer's step (not a test: a measurement) -------
#   OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tests/test_oom_trainer.py OUT_DIR [steps]
# Interleaved blocks in one process, on one DDP wrapper (the guard's): guard.run_step vs the
# trainer's plain trainer.step.run_step on the same batch, optimizer and objective.


def measure_overhead(out_dir: str, steps: int = 60, block: int = 5) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sddoctor.instrument.oom_guard import OOMGuard
    from trainer.models import build_models
    from trainer.objective import DiffusionObjective
    from trainer.optim import build_optimizer
    from trainer.step import run_step

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    cfg = build_config("tiny", None, [])
    torch.manual_seed(0)
    models = build_models("tiny")
    models.vae.to(device).requires_grad_(False).eval()
    models.text_encoder.to(device).requires_grad_(False).eval()
    unet = models.unet.to(device).train()
    optimizer = build_optimizer([p for p in unet.parameters() if p.requires_grad], cfg.optim, device)
    micro, accum = 8, 2
    guard = OOMGuard(
        unet,
        wrap=lambda m: DDP(m, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True),
        optimizer=optimizer,
        micro_batch=micro,
        grad_accum=accum,
        faults=[],
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    generator = torch.Generator(device=device).manual_seed(rank)
    objective = DiffusionObjective(cfg, models, device, dtype, torch.float32, generator)
    res = cfg.data.resolution
    captions = [f"a handwritten digit {i % 10}" for i in range(micro * accum)]
    batch = objective.prepare(
        {"pixel_values": torch.rand(micro * accum, 3, res, res) * 2 - 1, "caption": captions}
    )

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * steps + 2 * block):
        mode = "on" if (i // block) % 2 else "off"
        if i % block == 0:
            guard.settle()  # the guard's deferred agreement belongs to its own steps
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "on":
            guard.run_step(batch, objective.forward_backward, optimizer_step, step=i)
        else:
            run_step(guard.model, batch, micro, accum, objective.forward_backward, optimizer_step)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2 * block:  # the first on/off blocks warm up (DDP bucket rebuild, optimizer state)
            times[mode].append(time.perf_counter() - t0)
    guard.settle()
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    result = {"device": str(device), "on_ms": on * 1000, "off_ms": off * 1000, "overhead": on / off - 1}
    result["steps_each"] = len(times["on"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    print(
        f"rank {rank} {device}: median step guard off {off * 1000:.2f} ms, on {on * 1000:.2f} ms "
        f"({(on / off - 1) * 100:+.1f}%) over {len(times['on'])} steps each, interleaved blocks of {block}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    measure_overhead(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
