"""train.profile_steps: where the step time goes, recorded by torch.profiler in a real training run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env
from trainer.config import ConfigError, build_config
from trainer.step_profile import (
    HostOp,
    KernelTime,
    _union,
    format_summary,
    host_stacks,
    idle_gaps,
    kind_of,
    parse_steps,
    summarise,
)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (
            "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x128x64",
            "convolution",
        ),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "matmul"),
        ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::BFloat16>", "normalisation"),
        (
            "void at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda",
            "copies and layout",
        ),
        (
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("void at::native::index_scatter_kernel", "elementwise and other"),
        ("aten::mkldnn_convolution", "convolution"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_profile_steps_are_checked_with_the_config() -> None:
    assert parse_steps("") is None and parse_steps("12") == (12, 12) and parse_steps("11-13") == (11, 13)
    for bad in ("0-2", "5-3", "a-b"):
        with pytest.raises(ConfigError, match="train.profile_steps"):
            build_config(overrides=[f"train.profile_steps={bad}"])


def test_busy_time_counts_overlapping_kernels_once() -> None:
    assert _union([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_summary_shares_and_table() -> None:
    kernels = [
        KernelTime("conv_fprop", "convolution", 4, 6000.0),
        KernelTime("copy", "copies and layout", 8, 2000.0),
    ]
    summary = summarise(kernels, window_us=10_000.0, steps=2, device="cuda", busy_us=8000.0)
    assert summary["busy_share"] == 0.8 and summary["per_step_ms"] == 5.0
    assert summary["kinds"]["convolution"] == {"ms_per_step": 3.0, "share": 0.75}
    text = format_summary(summary)
    assert "GPU busy 80.0%" in text and "convolution" in text.splitlines()[3]


def test_host_stack_is_the_deepest_thread_at_that_time() -> None:
    ops = [
        HostOp("trainer: step", 0, 100, thread=1),
        HostOp("Optimizer.step#AdamW.step", 60, 90, thread=1),
        HostOp("aten::_foreach_norm", 70, 75, thread=1),
        HostOp("autograd::engine::evaluate_function: MulBackward0", 10, 40, thread=2),
        HostOp("aten::mul", 12, 20, thread=2),
        HostOp("aten::add", 30, 35, thread=2),
    ]
    stacks = host_stacks([72, 15, 50, 150, 32], ops)
    names = [[op.name for op in stack] for stack in stacks]
    assert names[0] == ["trainer: step", "Optimizer.step#AdamW.step", "aten::_foreach_norm"]
    assert names[1] == [
        "autograd::engine::evaluate_function: MulBackward0",
        "aten::mul",
    ]  # deeper than thread 1
    assert names[2] == ["trainer: step"]
    assert names[3] == []
    assert names[4] == ["autograd::engine::evaluate_function: MulBackward0", "aten::add"]


def test_idle_gaps_are_put_down_to_what_the_host_did() -> None:
    # Kernels (microseconds): busy 0-1000, a 50 us launch gap, busy to 2000, then idle 2000-5000
    # while the host is in the optimizer, idle 6000-8000 while it fetches data, overlapping kernels.
    spans = [
        (0.0, 1000.0, "k1"),
        (1050.0, 2000.0, "k2"),
        (5000.0, 6000.0, "adam"),
        (5500.0, 5800.0, "overlapping"),
        (8000.0, 9000.0, "conv"),
    ]
    ops = [
        HostOp("trainer: step", 0, 6000, thread=1),
        HostOp("Optimizer.step#MixedPrecisionAdamW.step", 1900, 5100, thread=1),
        HostOp("trainer: data", 6100, 7900, thread=1),
    ]
    idle = idle_gaps(spans, ops, steps=2, min_gap_us=100)
    assert idle is not None
    assert idle["ms_per_step"] == round((50 + 3000 + 2000) / 2000, 3)
    assert idle["short_ms_per_step"] == 0.025
    by_host = {row["host"]: row for row in idle["by_host"]}
    assert by_host["trainer: step > Optimizer.step#MixedPrecisionAdamW.step"] == {
        "host": "trainer: step > Optimizer.step#MixedPrecisionAdamW.step",
        "gaps": 1,
        "ms_per_step": 1.5,
    }
    assert by_host["trainer: data"]["ms_per_step"] == 1.0
    assert [(g["at_ms"], g["ms"], g["next_kernel"]) for g in idle["largest"]] == [
        (2.0, 3.0, "adam"),
        (6.0, 2.0, "conv"),
    ]
    summary = summarise(
        [KernelTime("k1", "elementwise and other", 1, 1000.0)], 9000.0, 2, "cuda", 4000.0, idle
    )
    text = format_summary(summary)
    assert "GPU idle between its first and last kernel: 2.52 ms per step" in text
    assert "trainer: data" in text and "adam" in text
    assert idle_gaps([], ops, steps=1) is None


def test_training_run_writes_the_profile(tmp_path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--output-dir", str(out), "--set", "train.max_steps=3",
         "train.micro_batch=2", "train.log_every=1", "train.profile_steps=2-3", "model.vae_warmup_steps=0",
         "data.max_samples=8", "data.cache=false", "sample.at_end=false", "checkpoint.at_end=false",
         "output.export=false"],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "profile of steps 2-3" in result.stdout
    summary = json.loads((out / "profile" / "rank-0.json").read_text())
    assert summary["steps"] == 2 and summary["device"] == "cpu"
    assert {"convolution", "attention"} <= set(summary["kinds"])
    assert abs(sum(k["share"] for k in summary["kinds"].values()) - 1.0) < 0.01
    assert not any(k["name"].startswith("trainer: ") for k in summary["top"])  # ranges, not operators
    assert (out / "profile" / "rank-0.trace.json.gz").stat().st_size > 0
    assert "convolution" in (out / "profile" / "rank-0.txt").read_text()
