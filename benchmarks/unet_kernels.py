"""Kernel-level benchmarks of SD2-base's UNet parts on one CUDA GPU: what each speed lever buys.

    python -m benchmarks.unet_kernels [--batch 48] [--iters 20] [--parts attention,norm]
                                      [--norm-variants native,nd-tiling] [--json results.json]

Prints, in one run, milliseconds of forward + backward per UNet step and ratios:
  - attention: every `scaled_dot_product_attention` call of one SD2-base UNet step (16
    transformer blocks, self- and cross-attention) with each SDPA kernel (cudnn, flash,
    efficient), against PyTorch's own choice;
  - norm: diffusers' ResnetBlock2D at SD2-base's shapes (64x64x320, 32x32x640, 16x16x1280;
    up-blocks' inputs concatenated from two tensors as in the UNet; channels_last, bf16,
    torch.compile) in each of NORM_VARIANTS: nn.GroupNorm, GroupNorm written in primitive
    operations (grouped as (N, G, C/G, HW) or in NHWC order), Inductor's N-D tiling of
    pointwise kernels, and the trainer's resnet forward without diffusers' NCHW copy of the
    shortcut's input (`keep-layout`); the 64x64 up-blocks' top kernels from the profiler.
Needs CUDA and diffusers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: SD2-base at 512 px: (sequence length, heads, transformer blocks at that size), head size 64
SD2_ATTENTION = ((4096, 5, 5), (1024, 10, 5), (256, 20, 5), (64, 20, 1))
TEXT_TOKENS = 77
#: SD2-base resnet shapes: (side, channels in, channels out, blocks of that shape per UNet step,
#: skip channels: up-blocks concatenate the previous output with a skip connection's channels)
SD2_RESNETS = (
    (64, 320, 320, 2, 0),
    (64, 960, 320, 1, 320),
    (64, 640, 320, 2, 320),
    (32, 640, 640, 1, 0),
    (32, 1920, 640, 1, 640),
    (32, 1280, 640, 1, 640),
    (32, 960, 640, 1, 320),
    (16, 1280, 1280, 1, 0),
    (16, 2560, 1280, 2, 1280),
    (16, 1920, 1280, 1, 640),
)


def cuda_ms(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of `fn` over `iters` calls (after 3 warm-up calls), by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def attention_step(batch: int, backend: str | None) -> Callable[[], None]:
    """One UNet step's SDPA calls, forward and backward, restricted to `backend` (None: auto)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    calls = []
    for seq, heads, blocks in SD2_ATTENTION:
        for kv in (seq, TEXT_TOKENS):
            q = torch.randn(batch, heads, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(batch, heads, kv, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            calls.append((q, k, v, blocks))

    def run() -> None:
        scope = sdpa_kernel([kernels[backend]]) if backend else torch.enable_grad()
        with scope:
            for q, k, v, blocks in calls:
                for _ in range(blocks):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    out.backward(torch.ones_like(out))

    return run


def bench_attention(batch: int, iters: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for backend in (None, "cudnn", "flash", "efficient"):
        name = backend or "auto"
        try:
            rows[name] = round(cuda_ms(attention_step(batch, backend), iters), 2)
        except RuntimeError as err:
            rows[name] = f"unavailable: {str(err).splitlines()[0][:100]}"
    return rows


class PrimitiveGroupNorm(nn.GroupNorm):
    """nn.GroupNorm's arithmetic (statistics in fp32, output in the input's dtype) written in
    primitive operations, so that Inductor generates its forward and backward itself. `nhwc`
    names the dimensions in channels_last memory order instead of (N, groups, C/groups, HW)."""

    nhwc = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.nhwc and input.dim() == 4:
            nhwc = input.permute(0, 2, 3, 1)
            batch, height, width, channels = nhwc.shape
            grouped = nhwc.float().reshape(batch, height * width, self.num_groups, -1)
            var, mean = torch.var_mean(grouped, dim=(1, 3), correction=0, keepdim=True)
            normed = ((grouped - mean) * torch.rsqrt(var + self.eps)).reshape(nhwc.shape)
            normed = normed * self.weight.float() + self.bias.float()
            return normed.to(input.dtype).permute(0, 3, 1, 2)
        batch, channels = input.shape[0], input.shape[1]
        grouped = input.float().reshape(batch, self.num_groups, channels // self.num_groups, -1)
        var, mean = torch.var_mean(grouped, dim=(2, 3), correction=0, keepdim=True)
        normed = ((grouped - mean) * torch.rsqrt(var + self.eps)).reshape(input.shape)
        affine_shape = (1, channels) + (1,) * (input.dim() - 2)
        normed = normed * self.weight.float().reshape(affine_shape)
        return (normed + self.bias.float().reshape(affine_shape)).to(input.dtype)


class NhwcGroupNorm(PrimitiveGroupNorm):
    nhwc = True


#: how a block is built and compiled: (GroupNorm class or None for nn.GroupNorm, Inductor options,
#: whether the block runs the trainer's forward instead of diffusers')
NORM_VARIANTS: dict[str, tuple[type[nn.GroupNorm] | None, dict[str, Any], bool]] = {
    "native": (None, {}, False),
    "primitive": (PrimitiveGroupNorm, {}, False),
    "primitive-nhwc": (NhwcGroupNorm, {}, False),
    "nd-tiling": (None, {"triton.prefer_nd_tiling": True}, False),
    # Inductor times neighbouring block sizes of each Triton kernel and keeps the fastest
    "coord-descent": (None, {"coordinate_descent_tuning": True}, False),
    # nn.GroupNorm in the trainer's resnet forward, without diffusers' NCHW copy of the
    # shortcut's input in training (trainer/unet_layout.py)
    "keep-layout": (None, {}, True),
}


def resnet_block(
    side: int,
    c_in: int,
    c_out: int,
    skip: int,
    batch: int,
    norm: type[nn.GroupNorm] | None,
    keep_layout: bool = False,
) -> Callable[[], None]:
    """Forward + backward of one compiled ResnetBlock2D (in training mode) whose input is `skip`
    channels concatenated to `c_in - skip` others (as in the UNet's up-blocks), or one tensor;
    `keep_layout`: with the trainer's forward instead of diffusers'."""
    from diffusers.models.resnet import ResnetBlock2D

    from trainer.unet_layout import keep_channels_last

    block = ResnetBlock2D(in_channels=c_in, out_channels=c_out, temb_channels=1280, groups=32)
    if keep_layout:
        keep_channels_last(block)
    block.to("cuda", torch.bfloat16)
    block.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it
    if norm is not None:
        for module in block.modules():
            if type(module) is nn.GroupNorm:
                module.__class__ = norm  # same parameters, other forward

    def activation(channels: int) -> torch.Tensor:
        x = torch.randn(batch, channels, side, side, device="cuda", dtype=torch.bfloat16)
        return x.to(memory_format=torch.channels_last).requires_grad_()

    parts = [activation(c_in - skip), activation(skip)] if skip else [activation(c_in)]
    temb = torch.randn(batch, 1280, device="cuda", dtype=torch.bfloat16)

    def step(*inputs: torch.Tensor) -> torch.Tensor:
        x = torch.cat(inputs, dim=1) if len(inputs) > 1 else inputs[0]
        return block(x, temb)

    compiled = torch.compile(step)

    def run() -> None:
        out = compiled(*parts)
        out.backward(torch.ones_like(out))

    return run


def top_kernels(fn: Callable[[], None], count: int = 8) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [f"{e.device_time_total / 1000:8.3f} ms {e.count:3d}x {e.key[:90]}" for e in events[:count]]


def bench_norm(batch: int, iters: int, variants: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    totals = dict.fromkeys(variants, 0.0)
    for side, c_in, c_out, blocks, skip in SD2_RESNETS:
        shape = f"{side}x{side} {c_in}->{c_out}" + (" (cat)" if skip else "")
        row: dict[str, Any] = {"blocks": blocks}
        for name in variants:
            norm, options, keep_layout = NORM_VARIANTS[name]
            torch._dynamo.reset()
            with torch._inductor.config.patch(options):  # read when the first call compiles
                run = resnet_block(side, c_in, c_out, skip, batch, norm, keep_layout)
                row[name] = round(cuda_ms(run, iters), 3)
                # as it goes: a variant whose compile runs past a time limit leaves the others
                print(f"{shape} {name}: {row[name]} ms", file=sys.stderr, flush=True)
                if side == 64 and skip:
                    row[f"{name} kernels"] = top_kernels(run, 5)
            totals[name] += row[name] * blocks
        rows[shape] = row
    rows["UNet step, resnet blocks (ms)"] = {k: round(v, 2) for k, v in totals.items()}
    rows["ratio to the first variant"] = {k: round(v / totals[variants[0]], 3) for k, v in totals.items()}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--parts", default="attention,norm")
    parser.add_argument("--norm-variants", default=",".join(NORM_VARIANTS), help="first one is the baseline")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    variants = args.norm_variants.split(",")
    unknown = sorted(set(variants) - set(NORM_VARIANTS)) + sorted(
        set(args.parts.split(",")) - {"attention", "norm"}
    )
    if unknown:
        print(
            f"unknown part or variant: {', '.join(unknown)}; norm variants: {', '.join(NORM_VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("unet_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch": args.batch,
    }
    for part in args.parts.split(","):
        if part == "attention":
            results[part] = bench_attention(args.batch, args.iters)
        else:
            results[part] = bench_norm(args.batch, args.iters, variants)
        print(json.dumps({part: results[part]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
