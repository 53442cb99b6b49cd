"""train.profile_steps: where the step time goes, recorded by torch.profiler in a real training run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env
from trainer.config import ConfigError, build_config
from trainer.step_profile import KernelTime, _union, format_summary, kind_of, parse_steps, summarise


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
    assert (out / "profile" / "rank-0.trace.json.gz").stat().st_size > 0
    assert "convolution" in (out / "profile" / "rank-0.txt").read_text()
