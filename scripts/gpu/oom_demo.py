"""A real CUDA OOM on a Stable Diffusion UNet and the OOM guard recovering from it (run via torchrun).

The process is limited to OOM_DEMO_LIMIT_GIB of the GPU (set_per_process_memory_fraction), so a
per-rank batch that fits an 80-141 GB card does not fit: the first step runs out of memory for
real, the guard falls back (micro-batch halves, accumulation doubles) until it fits, and training
goes on. Then the same steps are timed with the guard and with a plain no_sync accumulation loop
at the micro-batch the guard settled on (interleaved blocks, one process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sddoctor.instrument import api
from sddoctor.instrument.oom_guard import OOMGuard, OOMGuardError


def build_unet():
    from diffusers import UNet2DConditionModel

    # SD2-base layout at 0.6x width: ~0.3 B parameters, 64x64 latents (512 px images).
    return UNet2DConditionModel(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(192, 384, 768, 768),
        down_block_types=(
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "DownBlock2D",
        ),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=1024,
        attention_head_dim=(3, 6, 12, 12),
        use_linear_projection=True,
    )


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    limit_gib = float(os.environ.get("OOM_DEMO_LIMIT_GIB", "24"))
    per_rank = int(os.environ.get("OOM_DEMO_BATCH", "32"))

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * 2**30 / total), dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    api.enable(out / "run", rank=rank, world_size=dist.get_world_size(), device=str(dev), backend="nccl")

    torch.manual_seed(0)
    unet = build_unet().to(dev, memory_format=torch.channels_last)
    params = sum(p.numel() for p in unet.parameters())
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-5)
    guard = OOMGuard(
        unet,
        wrap=lambda m: DDP(m, device_ids=[dev.index], gradient_as_bucket_view=True),
        optimizer=opt,
        micro_batch=per_rank,
        grad_accum=1,
        enable_gradient_checkpointing=unet.enable_gradient_checkpointing,
    )

    def make_batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device=dev).manual_seed(step)
        return {
            "latents": torch.randn(per_rank, 4, 64, 64, device=dev, generator=g),
            "noise": torch.randn(per_rank, 4, 64, 64, device=dev, generator=g),
            "timesteps": torch.randint(0, 1000, (per_rank,), device=dev, generator=g),
            "text": torch.randn(per_rank, 77, 1024, device=dev, generator=g),
        }

    def forward_backward(model, mb, scale):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            noisy = mb["latents"] + mb["noise"]
            pred = model(
                noisy.contiguous(memory_format=torch.channels_last), mb["timesteps"], mb["text"]
            ).sample
            loss = torch.nn.functional.mse_loss(pred.float(), mb["noise"])
        (loss * scale).backward()
        return loss.detach()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    result: dict = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "params": params,
        "limit_gib": limit_gib,
        "per_rank_batch": per_rank,
        "steps": [],
    }
    print(
        f"UNet {params / 1e6:.0f} M params, memory limited to {limit_gib} GiB, per-rank batch {per_rank}",
        flush=True,
    )
    t_start = time.time()
    try:
        for step in range(6):
            torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            r = guard.run_step(make_batch(step), forward_backward, optimizer_step, step=step)
            loss = float(r.loss)
            guard.settle()
            dt = time.perf_counter() - t0
            row = {
                "step": step,
                "loss": round(loss, 5),
                "micro_batch": r.micro_batch,
                "grad_accum": r.grad_accum,
                "retries": r.retries,
                "fell_back": r.fell_back,
                "seconds": round(dt, 3),
                "peak_gib": gib(torch.cuda.max_memory_allocated(dev)),
            }
            result["steps"].append(row)
            print(json.dumps(row), flush=True)
    except OOMGuardError as exc:
        result["error"] = str(exc)
        print("OOMGuardError:", exc, flush=True)

    # Overhead: guard vs a plain no_sync loop at the same micro-batch/accumulation, interleaved
    # blocks. The plain loop drives the guard's own DDP wrapper (a second wrapper of the same
    # module would fight over the gradient bucket views), so the comm hook runs in both.
    if "error" not in result:
        mb, ga = guard.micro_batch, guard.grad_accum
        batch = make_batch(100)

        def plain_step():
            plain = guard.model
            for i in range(ga):
                chunk = {k: v[i * mb : (i + 1) * mb] for k, v in batch.items()}
                ctx = plain.no_sync() if i < ga - 1 else torch.enable_grad()
                with ctx:
                    loss = forward_backward(plain, chunk, 1 / ga)
            optimizer_step()
            return loss

        on, off = [], []
        for block in range(4):
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                float(plain_step())
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                float(guard.run_step(batch, forward_backward, optimizer_step, step=1000).loss)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if block:
                    off.append(t1 - t0)
                    on.append(t2 - t1)
        guard.settle()
        result["overhead"] = {
            "what": "median step time (synchronised) of run_step vs a plain no_sync loop on the same DDP wrapper",
            "micro_batch": mb,
            "grad_accum": ga,
            "off_ms": round(statistics.median(off) * 1e3, 2),
            "on_ms": round(statistics.median(on) * 1e3, 2),
            "overhead_pct": round((statistics.median(on) / statistics.median(off) - 1) * 100, 2),
            "samples": len(on),
        }
        print("overhead", json.dumps(result["overhead"]), flush=True)

    if not any(row["fell_back"] for row in result["steps"]) and "error" not in result:
        result["note"] = "no out-of-memory happened: lower OOM_DEMO_LIMIT_GIB or raise OOM_DEMO_BATCH"
        print(result["note"], flush=True)
    result["wall_s"] = round(time.time() - t_start, 1)
    api.disable()
    events = []
    for line in (out / "run" / "ranks" / f"rank-{rank:05d}.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] in ("oom", "fallback"):
            events.append(e)
    result["events"] = events
    for e in events:
        if e["kind"] == "oom":
            print(
                f"oom step {e['step']} {e['phase']} mb {e['micro_batch']} ga {e['grad_accum']} "
                f"alloc {gib(e['mem_alloc'])} reserved {gib(e['mem_reserved'])} GiB: {e['message'][:120]}"
            )
        else:
            print(
                f"fallback step {e['step']}: micro-batch {e['old_micro_batch']} -> {e['new_micro_batch']}, "
                f"accumulation {e['old_grad_accum']} -> {e['new_grad_accum']} ({e['reason']})"
            )
    (out / "oom_demo.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
