"""Rank 0's progress (live bar, lines with ETA, --quiet) and its trackers (TensorBoard, wandb offline).

The real runs: one tiny trainer on a pseudo-terminal draws rich's bar and writes TensorBoard and
an offline wandb run while a local listener stands in for every network address wandb or a proxy
could use (it must see no connection); one run with --quiet prints nothing. The 2-rank reference
run of tests/test_trainer_run.py checks TensorBoard's curves against the step telemetry.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, run_to_end, subprocess_env
from trainer.config import build_config
from trainer.process import Dist
from trainer.progress import Interval, Progress, clock
from trainer.tracking import TensorBoard, Tracker, TrackerUnavailable, Wandb, check_available
from trainer.train import Trainer, config_from_args, parse_args

# One rank, no VAE fit, no cache, no end checkpoint or export: start-up and 6 short steps.
TINY = [
    "--set",
    "model.vae_warmup_steps=0",
    "data.max_samples=32",
    "data.cache=false",
    "train.max_steps=6",
    "train.micro_batch=4",
    "train.log_every=2",
    "checkpoint.at_end=false",
    "output.export=false",
    "sample.prompts=a handwritten digit one",
    "sample.images_per_prompt=1",
    "sample.steps=2",
]


def interval(step: int = 50, **changes: float) -> Interval:
    values = dict(
        step=step,
        loss=0.2113,
        lr=1.1e-3,
        it_s=9.8,
        images_s=627.2,
        images_s_per_rank=313.6,
        step_time=0.1,
        data_wait=0.01,
        mem=0.55,
        mem_peak=0.6,
        elapsed=75.0,
        remaining=3725.0,
        grad_norm=0.5,
        oom_fallbacks=0,
        micro_batch=32,
        grad_accum=1,
    )
    values.update(changes)
    return Interval(**values)  # type: ignore[arg-type]


def test_lines_name_the_global_and_per_gpu_rates_and_the_time_left():
    out = io.StringIO()
    progress = Progress("auto", 100, 2, torch.device("cpu"), stream=out)  # not a terminal: lines
    assert progress.mode == "lines"
    progress.start(0)
    progress.advance(1)
    progress.show(interval())
    progress.close()
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.startswith("[##########----------] step 50/100 | 9.80 it/s | loss 0.2113 | ")
    assert "627.2 img/s all ranks (313.6/rank)" in line and "rss 0.55 GiB (peak 0.60)" in line
    assert line.rstrip().endswith("| lr 1.10e-03 | 1:15 elapsed, 1:02:05 left")
    gpu = io.StringIO()
    Progress("lines", 100, 2, torch.device("cuda", 0), stream=gpu).show(interval(remaining=None))
    assert (
        "(313.6/GPU)" in gpu.getvalue() and "mem 0.55 GiB" in gpu.getvalue() and "-:-- left" in gpu.getvalue()
    )
    quiet = io.StringIO()
    Progress("quiet", 100, 2, torch.device("cpu"), stream=quiet).show(interval())
    assert quiet.getvalue() == ""
    assert [clock(s) for s in (0, 59.6, 61, 3600, None, float("inf"))] == [
        "0:00",
        "1:00",
        "1:01",
        "1:00:00",
        "-:--",
        "-:--",
    ]


def test_quiet_keeps_warnings_and_the_flags_set_the_config(capsys):
    args = parse_args(["--quiet", "--report-to", "none"])
    cfg = config_from_args(args)
    assert (cfg.output.progress, cfg.output.report_to) == ("quiet", "none")
    trainer = Trainer(cfg)
    trainer.dist = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    trainer.log("training 6 steps")
    trainer.warn("careful")
    assert capsys.readouterr().out == "warning: careful\n"
    assert build_config().output.report_to == "tensorboard" and build_config().output.progress == "auto"


def test_a_missing_tracker_package_is_named_with_the_fix(monkeypatch):
    check_available("tensorboard")
    check_available("none")
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like to import
    with pytest.raises(TrackerUnavailable, match=r"needs the wandb package.*pip install wandb.*--report-to"):
        check_available("wandb")
    with pytest.raises(TrackerUnavailable, match="wandb"):
        check_available("all")


def test_a_tracker_that_fails_is_dropped_with_one_warning(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is optional: pip install wandb (the dev extra has it)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    warnings: list[str] = []
    try:
        backend = Wandb(tmp_path, "broken", {})
        backend.run.finish()  # from now on wandb refuses to log: a real failure of the backend
        tracker = Tracker([backend], warnings.append)
        tracker.scalars({"train/loss": 1.0}, 1)
        tracker.scalars({"train/loss": 0.5}, 2)
        tracker.close()
    finally:
        wandb.teardown()  # its service process, now rather than at the test session's exit
    assert len(warnings) == 1 and warnings[0].startswith("wandb: stopped writing (UsageError"), warnings
    assert "training goes on" in warnings[0] and tracker.backends == []


def test_a_resumed_run_replaces_the_tensorboard_events_after_its_checkpoint(tmp_path):
    first = TensorBoard(tmp_path, start_step=0)
    for step in range(1, 6):
        first.scalars({"train/loss": float(step)}, step)
    first.close()
    resumed = TensorBoard(tmp_path, start_step=3)  # stopped after step 5, resumed from step 3
    for step in (4, 5):
        resumed.scalars({"train/loss": 10.0 * step}, step)
    resumed.close()
    losses = [(e.step, e.value) for e in tensorboard_events(tmp_path).Scalars("train/loss")]
    assert losses == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


# -- real runs ---------------------------------------------------------------------------------


def run_on_terminal(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run `cmd` with stdout and stderr on a 120x30 pseudo-terminal; (exit code, what it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{' '.join(cmd[:4])} did not finish in {timeout:.0f} s")
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


class Listener:
    """A local TCP server that records every connection (a stand-in for the network)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history rows of an offline wandb run, read with wandb's own record format (a LevelDB log
    of `wandb_internal_pb2.Record` after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # FULL, FIRST
            pending = chunk
        elif kind in (3, 4):  # MIDDLE, LAST
            pending += chunk
        if kind in (1, 4):
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            )
    return rows


def tensorboard_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


@pytest.mark.slow
def test_live_bar_on_a_terminal_with_tensorboard_and_offline_wandb(tmp_path):
    pytest.importorskip("wandb", reason="wandb is optional: pip install wandb (the dev extra has it)")
    out = tmp_path / "run"
    listener = Listener()
    env = subprocess_env(
        WANDB_MODE="offline",
        WANDB_BASE_URL=listener.url,
        WANDB_PROJECT="sddoctor-test",
        TERM="xterm-256color",
        SDDOCTOR_CACHE_DIR=str(tmp_path / "cache"),
        SDDOCTOR_PREFLIGHT="0",
    )
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env[proxy] = listener.url  # any other address goes through the "proxy", and is seen
    for key in ("NO_PROXY", "no_proxy", "WANDB_API_KEY", "COLUMNS", "LINES"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "trainer", "--output-dir", str(out), "--report-to", "all", *TINY]
    try:
        code, shown = run_on_terminal(cmd, env, timeout=240)
    finally:
        listener.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown).replace("\r\n", "\n").replace("\r", "\n")
    assert code == 0, text[-3000:]
    assert listener.connections == 0, "wandb in offline mode opened a network connection"
    # rich's bar: the step, elapsed and remaining time; below it the latest interval's numbers
    lines = text.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("step 6/6 "))
    assert re.fullmatch(r"step 6/6 ━{20} 100% \| 0:\d\d elapsed, 0:00 left\s*", lines[last]), lines[last]
    stats = lines[last + 1]
    assert re.match(r"loss \d\.\d{4} \| [\d.]+ img/s all ranks \([\d.]+/rank\) \| rss [\d.]+ GiB", stats), (
        stats
    )
    assert "lr " in stats
    assert "training 6 steps from step 0" in text and "done: 6 steps" in text  # lines above the bar
    assert "[#####" not in text  # no plain lines on a terminal

    events = tensorboard_events(out / "tensorboard")
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert {"train/lr", "train/grad_norm", "perf/images_per_s", "memory/peak_gib"} <= set(
        events.Tags()["scalars"]
    )
    assert [e.step for e in events.Images("samples")] == [6]

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    losses = [row for row in rows if "train/loss" in row]
    assert [int(row["_step"]) for row in losses] == [2, 4, 6]
    assert {"perf/images_per_s_per_gpu", "oom/fallbacks", "train/grad_norm"} <= set(losses[-1])
    (image,) = [row for row in rows if "samples/_type" in row]
    assert image["samples/_type"] == '"image-file"' and int(image["_step"]) == 6


@pytest.mark.slow
def test_quiet_run_prints_nothing(tmp_path):
    env = subprocess_env(SDDOCTOR_CACHE_DIR=str(tmp_path / "cache"), SDDOCTOR_PREFLIGHT="0")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "--output-dir", str(out), "--quiet", "--report-to", "none", *TINY]
    code, output = run_to_end(cmd, timeout=240, env=env)
    assert code == 0, output[-3000:]
    assert output == "", output[-3000:]
    assert (out / "samples" / "step-00000006.png").is_file() and not (out / "tensorboard").exists()
