"""The zero-code-change bootstrap: which processes instrument themselves, and what they keep working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from instrument_fixtures import SCRIPT, events, reap

from conftest import REPO_ROOT, free_port, subprocess_env
from sddoctor.instrument.boot import RANK_PID_ENV, bootstrap_dir, is_rank_process, rank_environment
from sddoctor.instrument.flight_recorder import dump_files, trigger_dump


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env()
    env.update(rank_environment(run_dir, env))
    env.update(extra)
    return env


def test_torchrun_ranks_instrument_themselves_and_the_launcher_does_not(tmp_path: Path) -> None:
    # RANK in the launcher's own environment (as some schedulers set it) must not make it a rank
    env = _env(tmp_path, RANK="0")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(SCRIPT), "loop", "2"],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        launcher.wait(timeout=90)
    finally:
        (out,) = reap([launcher])
    assert launcher.returncode == 0, out
    assert sorted(p.name for p in (tmp_path / "ranks").glob("*.jsonl")) == [
        "rank-00000.jsonl",
        "rank-00001.jsonl",
    ]
    for rank in (0, 1):
        (start,) = events(tmp_path, rank, "start")
        assert start["bootstrap"] is True and start["pid"] != launcher.pid
        summary = events(tmp_path, rank, "collective")[-1]
        assert summary["last_seq"] == {"0": 3}  # two all-reduces and a barrier


def test_user_sitecustomize_still_runs_and_child_processes_are_not_ranks(tmp_path: Path) -> None:
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    env = _env(tmp_path / "run", RANK="0", WORLD_SIZE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap_dir()), str(user_dir), env["PYTHONPATH"]])
    code = (
        "import multiprocessing as mp, os\n"
        "from sddoctor.instrument import api\n"
        "def child(q):\n"
        "    from sddoctor.instrument import api\n"
        "    q.put(api.active() is not None)\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()\n"
        "    print(os.environ.get('USER_SITECUSTOMIZE'), api.active() is not None, q.get(timeout=60)); p.join()\n"
    )
    script = tmp_path / "rank_script.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "True", "False"]
    (start,) = events(tmp_path / "run", 0, "start")
    assert start["argv"] == [str(script)]


def test_a_malformed_fault_stops_the_rank_with_a_clear_message(tmp_path: Path) -> None:
    env = _env(tmp_path, RANK="0", SDDOCTOR_FAULT="skip:rank=1")
    out = subprocess.run(
        [sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "ran" not in out.stdout
    assert "SDDOCTOR_FAULT" in out.stderr and "lacks seq" in out.stderr and "Traceback" not in out.stderr


def test_enable_before_init_without_rank_env_learns_the_rank_from_the_process_group(tmp_path: Path) -> None:
    """mp.spawn-style scripts: no RANK in the environment; the rank comes from init_process_group."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "from sddoctor.instrument import api, ddp_patch\n"
        "api.enable(sys.argv[1])\n"
        "ddp_patch.add_post_construct(lambda m: print('POST', type(m).__name__, flush=True))\n"
        "dist.init_process_group('gloo', init_method=sys.argv[2], rank=int(sys.argv[3]), world_size=2)\n"
        "dist.all_reduce(torch.ones(3))\n"
        "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "dist.destroy_process_group()\n"
    )
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path), init, str(r)], env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in (1, 0)
    ]  # fmt: skip
    try:
        for p in procs:
            p.wait(timeout=90)
    finally:
        outs = reap(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("POST DistributedDataParallel" in out for out in outs)
    for rank, proc in ((1, procs[0]), (0, procs[1])):
        (start,) = events(tmp_path, rank, "start")
        assert start["rank"] == rank and start["pid"] == proc.pid
        assert events(tmp_path, rank, "collective")[-1]["ops"]["all_reduce"]["count"] == 1


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"RANK": "1"}, ["python", "train.py"], True),
        ({}, ["python", "train.py"], False),  # no RANK: not a rank
        ({"RANK": "0"}, ["python", "-m", "torch.distributed.run", "train.py"], False),
        ({"RANK": "0"}, ["/usr/bin/torchrun", "--nproc-per-node", "2", "train.py"], False),
        ({"RANK": "0"}, ["python", "/venv/bin/accelerate", "launch", "train.py"], False),
        (
            {"RANK": "0"},
            ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
            False,
        ),
        ({"RANK": "0", RANK_PID_ENV: "1"}, ["python", "train.py"], False),  # a child of rank pid 1
        ({"RANK": "0", "SDDOCTOR_BOOTSTRAP": "0"}, ["python", "train.py"], False),
    ],
)
def test_is_rank_process(env: dict[str, str], argv: list[str], expected: bool) -> None:
    assert is_rank_process({"SDDOCTOR_RUN_DIR": "/tmp/x", **env}, argv) is expected


def test_rank_environment_keeps_user_settings(tmp_path: Path) -> None:
    env = rank_environment(tmp_path, {"PYTHONPATH": "/user/lib", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})
    paths = env["PYTHONPATH"].split(os.pathsep)
    # ours first (our sitecustomize must win), the user's next, this checkout last
    assert paths[:2] == [str(bootstrap_dir()), "/user/lib"] and paths[2] == str(REPO_ROOT)
    assert (bootstrap_dir() / "sitecustomize.py").is_file()
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path.resolve() / "stacks" / "nccl_trace_rank_")
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str(tmp_path.resolve() / "stacks" / "nccl_pipe_rank_")
    assert env["SDDOCTOR_RUN_DIR"] == str(tmp_path.resolve())
    assert env["TORCH_INCLUDE_STACK_TRACE"] == "0"  # stacks come from py-spy
    assert rank_environment(tmp_path, {"TORCH_INCLUDE_STACK_TRACE": "1"})["TORCH_INCLUDE_STACK_TRACE"] == "1"


def test_flight_recorder_pipe_is_written_without_blocking(tmp_path: Path) -> None:
    prefix = tmp_path / "nccl_pipe_rank_"
    assert trigger_dump(prefix, 3) is False  # no pipe: nothing to do, no error
    fifo = Path(f"{prefix}3.pipe")  # the name torch gives it
    os.mkfifo(fifo)
    assert trigger_dump(prefix, 3) is False  # a pipe nobody reads: no block
    got: list[bytes] = []
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    reader = threading.Thread(target=lambda: got.append(os.read(fd, 16)))
    assert trigger_dump(prefix, 3) is True
    reader.start()
    reader.join(timeout=5)
    os.close(fd)
    assert got == [b"1\n"]
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "nccl_trace_rank_2").write_bytes(b"x")
    assert dump_files(tmp_path) == {2: tmp_path / "stacks" / "nccl_trace_rank_2"}


def test_hot_path_microbenchmark(tmp_path: Path) -> None:
    """Prints the per-call cost of tracing, of the timeline buffer and of step inference (numbers for
    the record, not timed assertions)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.instrument_overhead", "--micro", "--calls", "2000", "--json"],
        env=subprocess_env(), capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result, inference = json.loads(out.stdout)["results"]
    print(f"\ntracing hot path: {result['overhead_us']} us per call; gloo all_reduce "
          f"{result['gloo_all_reduce_untraced_us']} -> {result['gloo_all_reduce_traced_us']} us; "
          f"step inference {inference['inference_us']} us per step")  # fmt: skip
    assert result["recorded"]["0"] > 0  # the traced calls were really traced
    # the timeline buffer on the hot path and its writer on the heartbeat thread
    assert result["timeline_flush_us"] > 0 and isinstance(result["timeline_us"], float)
    assert inference["inference_us"] > 0


def test_a_scripts_own_sigterm_handler_still_runs(tmp_path: Path) -> None:
    code = (
        "import signal, sys, time\n"
        "def bye(signum, frame):\n"
        "    print('graceful', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=_env(tmp_path, RANK="0"), stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.terminate()
        proc.wait(timeout=20)
    finally:
        (out,) = reap([proc])
    assert proc.returncode == 0 and "graceful" in out
    assert events(tmp_path, 0, "exit")[-1]["status"] == "ok"


def test_a_single_process_without_rank_env_writes_as_rank_0(tmp_path: Path) -> None:
    code = "import sys\nfrom sddoctor.instrument import api\napi.enable(sys.argv[1])\napi.step(0, loss=1.5)\n"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=subprocess_env(), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [e["kind"] for e in events(tmp_path, 0)] == ["start", "step", "exit"]


CAUGHT_AND_REPORTED = """\
import logging, sys, traceback
logging.basicConfig(format="%(filename)s:%(lineno)d %(funcName)s %(message)s")
log = logging.getLogger("train")

def load():
    return 1 / 0  # RAISE

def main():
    try:
        load()
    except ZeroDivisionError:
        log.exception("loading failed")  # LOG
        traceback.print_exc()
        sys.exit(0)

main()
"""


def test_an_error_the_program_reports_and_survives_is_kept_and_its_report_unchanged(tmp_path: Path) -> None:
    """A rank that catches an error, logs it with logger.exception, prints it and ends with
    sys.exit(0): its output is what it would be without sddoctor (the log record names the
    program's own line and function, not sddoctor's wrapper), and its exit event keeps the error
    and the line that raised it."""
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT_AND_REPORTED)
    run_dir = tmp_path / "run"
    env = _env(run_dir, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    log_line = next(line for line in out.stderr.splitlines() if "loading failed" in line)
    assert log_line == "caught.py:12 main loading failed", out.stderr
    assert out.stderr.count("ZeroDivisionError: division by zero") == 2, out.stderr  # logged, printed
    (exit_event,) = events(run_dir, 0, "exit")
    caught = exit_event["handled_error"]
    assert (caught["type"], caught["caller"]) == ("ZeroDivisionError", f"{script}:6"), exit_event
    assert exit_event["status"] == "ok" and exit_event["caller"] == f"{script}:14", exit_event
