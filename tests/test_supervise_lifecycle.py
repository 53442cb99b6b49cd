"""No process of a job outlives `sddoctor run`, however it dies; the report says it died, and when.

Real jobs: 2 gloo ranks under torchrun, and 2 ranks started by torch.multiprocessing (spawn and
fork), each supervised by `sddoctor run`, which the test then SIGKILLs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from supervise_fixtures import SCRIPT, torchrun

from conftest import subprocess_env

MP_SCRIPT = """\
import os, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp

def work(index, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=world)
    import torch
    while True:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)

if __name__ == "__main__":
    mp.start_processes(work, args=(2, int(sys.argv[2])), nprocs=2, start_method=sys.argv[1])
"""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_supervisor_mid_run(
    tmp_path: Path, job: list[str], ranks: int, env: dict[str, str], processes: int = 0
) -> tuple[Path, list[psutil.Process], float]:
    """Start `sddoctor run -- JOB`, wait until `ranks` ranks report and the job has `processes`
    processes, SIGKILL sddoctor. Returns (run dir, every process of the job, when it was killed)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(run_dir), "--port", "0", "--", *job]
    with open(tmp_path / "sddoctor.err", "w") as err:
        sup = subprocess.Popen(
            cmd, env=subprocess_env(**env), stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path
        )
    me = psutil.Process(sup.pid)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 120
    try:
        while (
            len(list((run_dir / "ranks").glob("*.state"))) < ranks
            or len(me.children(recursive=True)) < processes
        ):
            assert sup.poll() is None, (tmp_path / "sddoctor.err").read_text()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        # the ranks in their loop (a loaded host starts them slowly), then a few heartbeats more
        while not _every_rank_in_its_loop(run_dir, ranks):
            assert sup.poll() is None, (tmp_path / "sddoctor.err").read_text()
            assert time.monotonic() < deadline, "the ranks did not reach their loop"
            time.sleep(0.1)
        time.sleep(2.0)
        for child in me.children(recursive=True):
            seen.setdefault(child.pid, child)
        assert len(seen) >= ranks + 1, "the launcher and the ranks should be running"
        killed_at = time.time()
        sup.send_signal(signal.SIGKILL)
        sup.wait()
    except BaseException:
        sup.kill()
        for p in seen.values():
            if _alive(p):
                p.kill()
        raise
    return run_dir, list(seen.values()), killed_at


def _every_rank_in_its_loop(run_dir: Path, ranks: int) -> bool:
    """Whether `ranks` ranks' state files show a finished step or an issued collective (a torn
    file reads as not yet)."""
    looping = 0
    for path in (run_dir / "ranks").glob("*.state"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        looping += bool(state.get("step") or (state.get("collectives") or {}).get("issued"))
    return looping >= ranks


def _assert_all_gone_within(procs: list[psutil.Process], seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not any(_alive(p) for p in procs):
            return time.monotonic() - start
        time.sleep(0.1)
    survivors = [p for p in procs if _alive(p)]
    for p in survivors:
        p.kill()
    raise AssertionError(f"{len(survivors)} processes outlived their supervisor by {seconds} s: {survivors}")


def _report(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", *extra, str(run_dir)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sigkill_of_the_supervisor_stops_a_torchrun_job_and_the_report_says_so(tmp_path):
    run_dir, procs, killed_at = _kill_supervisor_mid_run(
        tmp_path, torchrun(2, str(SCRIPT)), 2, {"STEPS": "100000", "PAUSE": "0.05"}
    )
    took = _assert_all_gone_within(procs, 10.0)
    print(f"all {len(procs)} processes gone {took:.2f} s after SIGKILL of the supervisor")
    stderr = (run_dir / "stderr.log").read_text()
    assert "BrokenPipeError" not in stderr, stderr[
        -2000:
    ]  # (torchrun's own SignalException is its answer to TERM)
    out = _report(run_dir, "--json")
    assert out.returncode == 0, out.stderr  # the ranks it stopped are not crashes
    report = json.loads(out.stdout)
    supervisor = report["supervisor"]
    assert supervisor["state"] == "died"
    assert killed_at - 2.5 <= supervisor["died_at"] <= killed_at + 0.5
    assert report["outcome"] == "supervisor_died" and report["verdicts"] == []
    text = _report(run_dir)
    assert "died at about" in text.stdout and "Traceback" not in text.stderr


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_sigkill_of_the_supervisor_stops_torch_multiprocessing_ranks(tmp_path, method):
    from conftest import free_port

    script = tmp_path / "mp_job.py"
    script.write_text(MP_SCRIPT)
    run_dir, procs, _ = _kill_supervisor_mid_run(
        tmp_path, [sys.executable, str(script), method, str(free_port())], 0, {}, processes=3
    )
    took = _assert_all_gone_within(procs, 10.0)
    print(f"{method}: all {len(procs)} processes gone {took:.2f} s after SIGKILL of the supervisor")


def test_a_clean_end_is_recorded_in_the_lease(tmp_path):
    from sddoctor.supervise.lifecycle import lease_status

    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sddoctor",
            "run",
            "--run-dir",
            str(run_dir),
            "--port",
            "-1",
            "--",
            sys.executable,
            "-c",
            "import sys; print('to stderr', file=sys.stderr)",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    status = lease_status(run_dir)
    assert status["state"] == "ended" and status["outcome"] == "ok" and status["exit_code"] == 0
    assert "to stderr" in out.stderr and (run_dir / "stderr.log").read_text() == "to stderr\n"


def test_a_job_writing_stderr_survives_a_supervisor_whose_own_stderr_is_gone(tmp_path):
    # The supervisor's stderr is a pipe nobody reads any more (a closed SSH session): the job's
    # stderr goes to the run dir's file, so the ranks never see EPIPE and finish normally.
    run_dir = tmp_path / "run"
    job = [sys.executable, "-c", "import sys\nfor i in range(20000): print('x' * 100, i, file=sys.stderr)"]
    sup = subprocess.Popen(
        [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(run_dir), "--port", "-1", "--", *job],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    sup.stderr.close()  # nobody reads sddoctor's stderr from here on
    sup.wait(timeout=120)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["job_exit_code"] == 0 and report["outcome"] == "ok", report["verdicts"]
    assert (run_dir / "stderr.log").read_text().count("\n") == 20000


def test_a_process_no_parent_watches_stops_itself_through_the_lease(tmp_path):
    # The launcher starts a worker in a session of its own and nothing ties the worker to its
    # parent: only the worker's own watchdog (the lease) can notice that the supervisor is gone.
    ready = tmp_path / "worker-ready"
    worker = f"import os, pathlib, time; os.setsid(); pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {worker!r}])\ntime.sleep(600)\n"
    )
    run_dir, procs, _ = _kill_supervisor_mid_run(
        tmp_path, [sys.executable, str(launcher)], 0, {}, processes=2
    )
    assert ready.exists()
    took = _assert_all_gone_within(procs, 10.0)
    print(f"detached worker gone {took:.2f} s after SIGKILL of the supervisor")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hang_kill_lets_a_ranks_own_sigterm_handler_finish_its_checkpoint(tmp_path):
    # Rank 1 stops in Python and hangs the job; --on-hang kill sends SIGTERM, and rank 1's handler
    # takes 4 s to save. The stop must wait for it (a SIGKILL would leave a half-written file).
    from client_fixtures import CLIENTS
    from supervise_fixtures import run_supervised

    res = run_supervised(
        tmp_path,
        torchrun(2, "--standalone", str(CLIENTS / "save_on_sigterm.py")),
        options=("--hang-timeout", "4", "--on-hang", "kill"),
        env={"STALL": "1", "OMP_NUM_THREADS": "1", "CHECKPOINT_DIR": str(tmp_path)},
    )
    assert res.returncode == 124, res.stderr
    assert (tmp_path / "checkpoint-1.pt").read_text() == "step weights complete\n"
    assert not list(tmp_path.glob("*.partial"))
    assert "rank 1 (pid" in res.stderr and "exited with code 0" in res.stderr, res.stderr
