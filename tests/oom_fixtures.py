"""A small multi-bucket DDP training run under the OOM guard, one process per rank.

Run as `python tests/oom_fixtures.py CONFIG_JSON OUT_DIR` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (launch_ranks() does that). It trains a guarded run (faults from SDDOCTOR_FAULT),
then, in the same processes, an unguarded-by-faults reference run that uses `reference_micro_batch`
from the first step; each rank writes OUT_DIR/rank-R.json with losses, final settings and a
parameter digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Net:
    """Builds the model lazily so that importing this module needs no torch."""

    @staticmethod
    def make(width: int, depth: int, with_buffer: bool):
        import torch

        class _Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
                self.head = torch.nn.Linear(width, 1)
                if with_buffer:
                    self.register_buffer("seen", torch.zeros(()))

            def forward(self, x):
                # Layers run in reverse definition order, so DDP's rebuilt buckets (in gradient
                # arrival order) differ from the initial ones (reverse definition order).
                for layer in reversed(self.layers):
                    x = torch.tanh(layer(x))
                if hasattr(self, "seen"):
                    self.seen += x.shape[0]
                return self.head(x).squeeze(-1)

        return _Net()


def batch_for(step: int, rank: int, size: int, width: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, width, generator=g)
    y = torch.randn(size, generator=g)
    return {"x": x, "y": y, "ids": [f"{step}-{rank}-{i}" for i in range(size)]}


def train(cfg: dict[str, Any], micro_batch: int, guarded_faults: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sddoctor.instrument.faults import faults_from_env
    from sddoctor.instrument.oom_guard import OOMGuard

    torch.manual_seed(0)
    width, depth = cfg.get("width", 32), cfg.get("depth", 6)
    model = Net.make(width, depth, cfg.get("with_buffer", False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    per_rank = cfg["per_rank_batch"]
    bucket_mb = cfg.get("bucket_cap_mb", 0.004)  # ~1000 floats: one or two layers per bucket
    guard = OOMGuard(
        model,
        wrap=lambda m: DDP(m, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=cfg.get("bucket_view", True)),
        optimizer=opt,
        micro_batch=micro_batch,
        grad_accum=per_rank // micro_batch,
        extra_state=[sched],
        faults=faults_from_env() if guarded_faults else [],
        enable_gradient_checkpointing=(lambda: None) if cfg.get("checkpointing") else None,
    )

    error_at = cfg.get("error_at") if guarded_faults else None  # [rank, step]: a bug, not an OOM

    def forward_backward(m, mb, scale):
        if error_at and error_at == [dist.get_rank(), current[0]]:
            raise ValueError("a bug in the user's loss function")
        if guarded_faults and cfg.get("oom_before_model") == [dist.get_rank(), current[0]] and scale == 1.0:
            # Like a VAE encode that runs out of memory before the UNet (DDP) forward is entered.
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (VAE encode)")
        loss = torch.nn.functional.mse_loss(m(mb["x"]), mb["y"])
        (loss * scale).backward()
        return loss.detach()

    def optimizer_step():
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    rank = dist.get_rank()
    losses, settings = [], []
    step_times = []
    current = [0]
    for step in range(cfg.get("steps", 5)):
        current[0] = step
        batch = batch_for(step, rank, per_rank, width)
        t0 = time.perf_counter()
        result = guard.run_step(batch, forward_backward, optimizer_step, step=step)
        step_times.append(time.perf_counter() - t0)
        losses.append(float(result.loss))
        settings.append([result.micro_batch, result.grad_accum, result.retries, result.fell_back])
    guard.settle()  # the last step's optimizer agreement
    settings.append([guard.micro_batch, guard.grad_accum, 0, False])
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(t.detach().contiguous().numpy().tobytes())
    return {
        "losses": losses,
        "settings": settings,
        "guard_state": guard.state_dict(),
        "digest": digest.hexdigest(),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "lr": opt.param_groups[0]["lr"],
        "step_times": step_times,
        "hook_stats": guard.stats(),
        "n_buckets": len(guard.hook_state.layout),
    }


def bench(cfg: dict[str, Any]) -> dict[str, Any]:
    """Per-step time of the same model with and without the guard, interleaved blocks, one run."""
    import statistics

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sddoctor.instrument.oom_guard import OOMGuard

    torch.manual_seed(0)
    width, per_rank = cfg.get("width", 256), cfg["per_rank_batch"]
    plain_model = Net.make(width, cfg.get("depth", 8), False)
    guarded_model = Net.make(width, cfg.get("depth", 8), False)
    plain = DDP(plain_model, bucket_cap_mb=1)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(guarded_model.parameters(), lr=1e-3)
    guard = OOMGuard(
        guarded_model, wrap=lambda m: DDP(m, bucket_cap_mb=1), optimizer=opt, micro_batch=per_rank, faults=[]
    )
    batch = batch_for(0, dist.get_rank(), per_rank, width)

    def fb(m, mb, scale):
        loss = torch.nn.functional.mse_loss(m(mb["x"]), mb["y"])
        (loss * scale).backward()
        return loss.detach()

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain_step():
        fb(plain, batch, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    # A third variant: the guard with its control-plane agreements left out (what they cost).
    quiet_model = Net.make(width, cfg.get("depth", 8), False)
    quiet_opt = torch.optim.AdamW(quiet_model.parameters(), lr=1e-3)
    quiet = OOMGuard(
        quiet_model,
        wrap=lambda m: DDP(m, bucket_cap_mb=1),
        optimizer=quiet_opt,
        micro_batch=per_rank,
        faults=[],
    )
    quiet.distributed = False

    def quiet_step():
        quiet_opt.step()
        quiet_opt.zero_grad(set_to_none=True)

    on, off, no_agree = [], [], []
    for block in range(cfg.get("blocks", 4)):
        for _ in range(cfg.get("steps_per_block", 12)):
            t0 = time.perf_counter()
            plain_step()
            t1 = time.perf_counter()
            guard.run_step(batch, fb, opt_step, step=0)
            t2 = time.perf_counter()
            quiet.run_step(batch, fb, quiet_step, step=0)
            t3 = time.perf_counter()
            if block:  # the first block warms up
                off.append(t1 - t0)
                on.append(t2 - t1)
                no_agree.append(t3 - t2)
    agree = []
    for _ in range(200):
        t0 = time.perf_counter()
        work, _ = guard._launch_agreement(0, 0)
        work.wait()
        agree.append(time.perf_counter() - t0)
    return {
        "off_ms": statistics.median(off) * 1e3,
        "on_ms": statistics.median(on) * 1e3,
        "agree_ms": statistics.median(agree) * 1e3,
        "no_agree_ms": statistics.median(no_agree) * 1e3,
        "params": sum(p.numel() for p in guarded_model.parameters()),
    }


def main() -> int:
    import torch
    import torch.distributed as dist

    cfg = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    result: dict[str, Any] = {"rank": rank}
    if cfg.get("telemetry"):
        from sddoctor.instrument import api

        api.enable(out / "run")
    try:
        if cfg.get("bench"):
            result["bench"] = bench(cfg)
            raise SystemExit  # skip the training runs
        result["guarded"] = train(cfg, cfg["micro_batch"], guarded_faults=True)
        if cfg.get("reference_micro_batch"):
            result["reference"] = train(cfg, cfg["reference_micro_batch"], guarded_faults=False)
    except SystemExit:
        pass
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "tb": traceback.format_exc()}
    if cfg.get("telemetry"):
        api.disable()
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    # Skip destroy_process_group: a rank that raised may have left peers mid-collective.
    sys.stdout.flush()
    os._exit(0)


def launch_ranks(
    cfg: dict[str, Any], out: Path, world: int, fault: str | None, timeout: float = 90
) -> list[dict]:
    """Start `world` rank processes, wait for all (killing them on timeout), return their results."""
    from conftest import free_port, subprocess_env

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = subprocess_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **({"SDDOCTOR_FAULT": fault} if fault else {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "oom_fixtures.py"), json.dumps(cfg), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ranks still running after {timeout:.0f} s (a hang)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank in range(world):
        path = out / f"rank-{rank}.json"
        assert path.exists(), (
            f"rank {rank} wrote no result; output:\n{logs[rank] if rank < len(logs) else ''}"
        )
        results.append(json.loads(path.read_text()))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    raise SystemExit(main())
