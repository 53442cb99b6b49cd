"""The job's stderr as the supervisor follows it: the console gets every byte, the diagnosis a
bounded tail (a progress bar redrawn in place is one line, however many times it was drawn)."""

from __future__ import annotations

import io
import threading

from supervise_fixtures import run_supervised, torchrun

from sddoctor.supervise.lifecycle import TAIL_LINE_END, TAIL_LINE_HEAD, StderrLog, tail_text

BAR_REDRAWS = 60_000


def progress_bar(redraws: int) -> str:
    return "".join(f"\rtraining {i:6d}/{redraws} |{'#' * 30}|" for i in range(redraws))


def test_a_line_redrawn_with_carriage_returns_keeps_what_a_terminal_shows() -> None:
    assert tail_text(progress_bar(3)) == f"training      2/3 |{'#' * 30}|"
    assert tail_text("RuntimeError: boom\r") == "RuntimeError: boom"  # a CRLF line ending
    # an error written after a bar on the same line stays whole
    assert tail_text("\r 50%|#####|\r 60%|######|Traceback (most recent call last):") == (
        " 60%|######|Traceback (most recent call last):"
    )


def test_a_very_long_line_keeps_its_start_and_its_end() -> None:
    line = "ValueError: " + "x" * 50_000 + " the end"
    kept = tail_text(line)
    assert len(kept) < TAIL_LINE_HEAD + TAIL_LINE_END + 40
    assert kept.startswith("ValueError: xxx") and kept.endswith("x the end")
    assert f"[... {len(line) - TAIL_LINE_HEAD - TAIL_LINE_END} characters ...]" in kept
    assert tail_text("short line") == "short line"


def test_the_console_gets_every_byte_and_the_tail_stays_small(tmp_path) -> None:
    log = StderrLog(tmp_path)
    written = progress_bar(BAR_REDRAWS) + "\nTraceback (most recent call last):\nRuntimeError: boom\n"
    sink, tail, stop = io.StringIO(), [], threading.Event()
    follower = threading.Thread(target=log.follow, args=(sink, tail.append, stop))
    follower.start()
    with open(log.path, "a", encoding="utf-8") as job_stderr:
        job_stderr.write(written)
    stop.set()
    follower.join(timeout=60)
    assert not follower.is_alive()
    assert sink.getvalue() == written
    assert max(len(line) for line in tail) <= TAIL_LINE_HEAD + TAIL_LINE_END + 40
    assert tail[-2:] == ["Traceback (most recent call last):", "RuntimeError: boom"]
    assert tail[-3].startswith(f"training {BAR_REDRAWS - 1:6d}/{BAR_REDRAWS}")


NOISY_RANKS = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
for i in range({redraws}):
    sys.stderr.write(f"\\rrank {{rank}} step {{i:6d}} |{{'#' * 30}}|")
    if i % 10000 == 0:
        dist.all_reduce(torch.ones(1))
sys.stderr.write("\\n")
if rank == 1:
    raise RuntimeError("rank 1 gave up after its progress bar")
dist.destroy_process_group()
"""


def test_a_job_that_redraws_a_progress_bar_is_diagnosed_from_a_bounded_tail(tmp_path) -> None:
    script = tmp_path / "noisy.py"
    script.write_text(NOISY_RANKS.format(redraws=BAR_REDRAWS))
    run = run_supervised(tmp_path, torchrun(2, str(script)), timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    crash = next(v for v in run.report["verdicts"] if v["kind"] == "crash")
    assert crash["culprit_rank"] == 1 and "rank 1 gave up" in crash["summary"]
    tail = run.report["launcher"]["stderr_tail"]
    assert tail and max(len(line) for line in tail) <= TAIL_LINE_HEAD + TAIL_LINE_END + 40
    # the console still got every redraw of both bars (as separate lines: text mode reads \r as one)
    assert run.stderr.count("rank 1 step") == BAR_REDRAWS
