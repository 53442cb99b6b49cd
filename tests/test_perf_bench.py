"""trainer.bench end to end on CPU: tiny preset, reference loop and trainer, 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env
from trainer import bench


def test_bench_measures_reference_and_trainer_on_one_and_two_ranks(tmp_path):
    out = tmp_path / "perf" / "bench.json"
    cmd = [
        sys.executable, "-m", "trainer.bench", "--preset", "tiny", "--nproc", "1,2",
        "--cases", "reference@4,default@4", "--steps", "2", "--warmup", "2",
        "--workdir", str(tmp_path / "work"), "--out", str(out), "--timeout", "200",
    ]  # fmt: skip
    result = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the table on stdout, with every column the blog's table lacked
    for title in ("GPUs", "batch/GPU", "global", "it/s", "images/s", "img/s/GPU", "peak GiB/GPU",
                  "TFLOP/s", "% peak", "scaling", "vs ref"):  # fmt: skip
        assert title in result.stdout
    report = json.loads(out.read_text())
    assert (tmp_path / "perf" / "bench.json.txt").read_text().strip() == result.stdout.strip()
    assert report["tflop_per_image"] > 0
    rows = {(r["loop"], r["gpus"]): r for r in report["rows"]}
    assert set(rows) == {("reference", 1), ("reference", 2), ("default", 1), ("default", 2)}
    for (_loop, gpus), r in rows.items():
        assert r["ok"], r["error"]
        assert r["per_gpu_batch"] == 4 and r["global_batch"] == 4 * gpus
        assert r["images_s"] > 0 and r["it_s"] > 0
        assert r["images_s"] == pytest.approx(r["it_s"] * r["global_batch"], rel=1e-6)
        assert r["images_s_per_gpu"] == pytest.approx(r["images_s"] / gpus)
        assert r["tflops"] == pytest.approx(r["images_s"] * report["tflop_per_image"])
    for loop in ("reference", "default"):
        one, two = rows[(loop, 1)], rows[(loop, 2)]
        assert one["scaling_efficiency"] is None
        assert two["scaling_efficiency"] == pytest.approx(two["images_s"] / (2 * one["images_s"]))
    default = rows[("default", 1)]
    assert default["vs_reference"] == pytest.approx(default["images_s"] / rows[("reference", 1)]["images_s"])
    assert default["data_wait_share"] is None or 0 <= default["data_wait_share"] <= 1
    # the trainer ran through its real entry point with telemetry on: one run dir per case, both ranks
    assert sorted(p.name for p in (tmp_path / "work").glob("*-default-b4-n2/ranks/*.jsonl")) == [
        "rank-00000.jsonl",
        "rank-00001.jsonl",
    ]


def test_a_case_past_its_timeout_is_stopped_and_becomes_a_failed_row(tmp_path):
    cmd = [
        sys.executable, "-m", "trainer.bench", "--preset", "tiny", "--cases", "default@4",
        "--steps", "1", "--warmup", "1", "--timeout", "1", "--json", "--workdir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == bench.EXIT_SOME_FAILED, result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["rows"]
    assert not row["ok"] and row["error"] == "timed out" and row["images_s"] is None
    assert (tmp_path / "00-default-b4-n1.log").read_text().startswith("$ ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cases", "fastest@8"], "unknown loop 'fastest'"),
        (["--cases", "default"], "LOOP@BATCH"),
        (["--batch", "0"], "positive integers"),
        (["--warmup", "0"], "--warmup must be at least 1"),
        (["--preset", "sdxl"], "unknown --preset"),
        (["--cases", "default@4", "--sweep-ddp"], "at least 2 ranks"),
        (["--gpu-idle", "--warmup", "2"], "use --warmup 4 or more"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == bench.EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_ddp_sweep_plans_every_bucket_and_view_and_log_interval_divides_the_window():
    args = bench.parse_args(["--nproc", "1,2", "--cases", "best@8", "--sweep-ddp", "--ddp-buckets", "25,100"])
    sweep = [c for c in args.case_list if c.extra]
    assert [
        (c.nproc, c.extra["ddp.bucket_cap_mb"], c.extra["ddp.gradient_as_bucket_view"]) for c in sweep
    ] == [
        (2, 25, True),
        (2, 25, False),
        (2, 100, True),
        (2, 100, False),
    ]
    for warmup, steps in ((10, 20), (5, 15), (3, 7), (12, 30)):
        every = bench.log_interval(warmup, steps)
        assert warmup % every == 0 and steps % every == 0 and 1 <= every <= 10


def test_flop_count_matches_the_sd2_anchor_within_five_percent():
    # a published 2.47 TFLOP per image for SD2-base fwd+bwd at 512 px (meta device: no memory)
    assert bench.unet_flops_per_image("sd2-base", 512) / 1e12 == pytest.approx(2.47, rel=0.05)


def test_max_batch_search_doubles_then_follows_the_memory_line_then_bisects():
    # one fitting probe: double
    assert bench.next_probe(4, 0, [(4, 8.0)], 23.0) == 8
    # two fitting probes 1 GiB apart per 4 images: the line says 64, capped at 4x the last fit
    assert bench.next_probe(8, 0, [(4, 8.0), (8, 9.0)], 23.0) == 32
    # a failure above: the guess (64) is outside (8, 40), so bisect
    assert bench.next_probe(8, 40, [(4, 8.0), (8, 9.0)], 23.0) == 24
    # a guess strictly inside the interval is taken
    assert bench.next_probe(32, 64, [(4, 8.0), (32, 16.0)], 23.0) == 56
    # no peaks known (CPU or a failed read): plain bisection
    assert bench.next_probe(4, 8, [], 23.0) == 6


def test_table_marks_failed_rows_and_keeps_columns_aligned():
    ok = bench.Row(bench.Case("default", 8, 1), ok=True, it_s=2.0, images_s=16.0, mem_peak=3 * bench.GIB)
    bad = bench.Row(bench.Case("best", 8, 1), ok=False, error="exit 2: unknown config key")
    rows = [r.as_dict(1e12, 100.0) for r in (ok, bad)]
    bench.add_comparisons(rows)
    report = {"preset": "tiny", "resolution": 32, "device": "cpu", "tflop_per_image": 1.0,
              "peak_tflops": 100.0, "steps": 2, "warmup": 2, "rows": rows}  # fmt: skip
    lines = bench.format_table(report).splitlines()
    assert "FAILED: exit 2: unknown config key" in lines[3] and len(lines) == 4
    assert lines[2].split() == ["default", "1", "8", "8", "2.00", "16.0", "16.0", "3.0", "16", "16.0%",
                                "-", "-", "-"]  # fmt: skip


def test_table_says_below_it_when_the_oom_guard_lowered_a_rows_micro_batch():
    row = bench.Row(bench.Case("saver", 64, 1), ok=True, it_s=0.7, images_s=43.6, mem_peak=20 * bench.GIB)
    row.extra = {"fallbacks": 1, "micro_batches": [32], "note": "the OOM guard lowered the micro-batch"}
    report = {"preset": "sd2-base", "resolution": 512, "device": "cuda", "tflop_per_image": 2.4,
              "peak_tflops": 700.0, "steps": 6, "warmup": 3, "rows": [row.as_dict(2.4e12, 700.0)]}  # fmt: skip
    lines = bench.format_table(report).splitlines()
    assert lines[-1].startswith(
        "saver@64: the OOM guard lowered the micro-batch (to 32), same effective batch"
    )


def test_gpu_idle_profiles_warm_up_steps_and_reads_the_idle_share(tmp_path):
    cmd = [
        sys.executable, "-m", "trainer.bench", "--preset", "tiny", "--cases", "default@4", "--gpu-idle",
        "--steps", "1", "--warmup", "4", "--json", "--workdir", str(tmp_path), "--timeout", "200",
    ]  # fmt: skip
    result = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    (row,) = report["rows"]
    assert report["gpu_idle"] and row["ok"]
    # the trainer profiled steps 2-3, inside the warm-up; a CPU has no GPU timeline to read idle from
    profile = json.loads((tmp_path / "00-default-b4-n1" / "profile" / "rank-0.json").read_text())
    assert profile["steps"] == 2 and row["profile"].endswith("rank-0.txt")
    assert row["gpu_idle_share"] is None
    assert "GPU idle" in bench.format_table(report)


def test_gpu_idle_share_comes_from_the_step_profile(tmp_path):
    from trainer.step_profile import KernelTime, idle_gaps, summarise

    spans = [(0.0, 6000.0, "conv"), (8000.0, 10_000.0, "adam")]  # 2 ms idle in a 10 ms step
    idle = idle_gaps(spans, [], steps=1)
    summary = summarise([KernelTime("conv", "convolution", 1, 8000.0)], 10_000.0, 1, "cuda", 8000.0, idle)
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank-0.json").write_text(json.dumps(summary))
    read = bench.read_gpu_idle(tmp_path)
    assert read["gpu_idle_ms_per_step"] == 2.0 and read["gpu_idle_share"] == pytest.approx(0.2)
    assert bench.read_gpu_idle(tmp_path / "missing")["gpu_idle_share"] is None
    row = bench.Row(bench.Case("default", 8, 1), ok=True, it_s=2.0, images_s=16.0, extra=read).as_dict(
        1e12, 100.0
    )
    report = {"preset": "tiny", "resolution": 32, "device": "cpu", "tflop_per_image": 1.0, "gpu_idle": True,
              "peak_tflops": 100.0, "steps": 2, "warmup": 4, "rows": [row]}  # fmt: skip
    lines = bench.format_table(report).splitlines()
    assert lines[1].endswith("GPU idle")
    assert lines[2].split()[-1] == "20.0%"
