"""`sddoctor run` from launch on, and around the run: start-up hangs (torchrun and mp.spawn), one run
per run directory, the report read again from the files, sddoctor's own failures inside a rank, and
py-spy found without an activated environment. Real gloo jobs on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from supervise_fixtures import SCRIPT, run_supervised, torchrun

from conftest import REPO_ROOT, free_port, subprocess_env

pytestmark = pytest.mark.slow

STUCK_BEFORE_INIT = textwrap.dedent(
    """\
    import os, sys, time
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def load_model(rank):
        how = os.environ.get("HOW", "sleep")
        if rank == 1 and how == "raise":
            raise FileNotFoundError("no checkpoint for rank 1")  # RAISE: before init_process_group
        if rank == 1 and how == "kill":
            os.kill(os.getpid(), 9)  # as the OOM killer would
        if rank == 1:
            time.sleep(3600)  # LOAD: a model load that never finishes

    def worker(rank, world_size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        load_model(rank)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)  # INIT
        dist.all_reduce(torch.ones(1))

    if __name__ == "__main__":
        if "RANK" in os.environ:  # under torchrun
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        else:
            mp.spawn(worker, args=(2,), nprocs=2)
    """
)


def _line(script: Path, marker: str) -> str:
    (number,) = [i for i, text in enumerate(script.read_text().splitlines(), 1) if marker in text]
    return f"{script}:{number}"


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_rank_stuck_before_init_is_a_startup_hang(tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_BEFORE_INIT)
    job = torchrun(2, str(script)) if launcher == "torchrun" else [sys.executable, str(script)]
    # the allowance must cover importing torch on a loaded 2-core machine (seen to take 20 s)
    options = ("--hang-timeout", "3", "--startup-timeout", "40", "--on-hang", "kill")
    started = time.monotonic()
    res = run_supervised(tmp_path, job, options=options, env={"MASTER_PORT": str(free_port())})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.startup", 1), v
    assert v["location"] == _line(script, "# LOAD"), v
    assert v["details"]["waiting_ranks"] == [0] and "init_process_group" in v["summary"], v
    assert f"called at {_line(script, '# INIT')}" in v["summary"]
    # the start-up allowance, then at most a few seconds to diagnose
    assert time.monotonic() - started < 40 + 25
    stacks = sorted(p.name for p in (res.run_dir / "stacks").glob("*.json"))
    if launcher == "spawn":  # the worker had not joined: its stack is kept under its pid
        assert "mp.spawn worker 1" in v["summary"]
        assert any(name.startswith("pid-") for name in stacks), stacks
    else:
        assert "rank-00001.json" in stacks


@pytest.mark.parametrize("how", ["raise", "kill"])
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_worker_that_dies_before_init_is_the_crash_not_the_rank_it_left_waiting(
    tmp_path: Path, launcher: str, how: str
) -> None:
    """Under mp.spawn the dead worker never became a rank (no RANK, no rank file) and rank 0 dies
    of the parent's SIGTERM: the worker, by its spawn index, is the crash, not rank 0."""
    script = tmp_path / "dies.py"
    script.write_text(STUCK_BEFORE_INIT)
    job = torchrun(2, str(script)) if launcher == "torchrun" else [sys.executable, str(script)]
    env = {"MASTER_PORT": str(free_port()), "HOW": how}
    res = run_supervised(tmp_path, job, options=("--hang-timeout", "5", "--on-hang", "kill"), env=env)
    assert res.returncode == 1, res.stderr
    (v,) = res.verdicts()
    assert (v["kind"], v["culprit_rank"]) == ("crash", 1), v
    if how == "raise":
        assert v["location"] == _line(script, "# RAISE"), v
        assert "FileNotFoundError: no checkpoint for rank 1" in v["summary"], v
    else:
        assert "SIGKILL" in v["summary"] or "signal 9" in v["summary"], v
    if launcher == "spawn":
        assert v["summary"].startswith("mp.spawn worker 1 ") and v["details"]["joined"] is False, v
        assert v["details"]["consequences"] in ([], [0]), v


def test_every_rank_waiting_in_init_is_a_rendezvous_that_cannot_complete(tmp_path: Path) -> None:
    """World size 3, two processes: both wait in init_process_group for a rank that never comes."""
    script = tmp_path / "short.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "os.environ['MASTER_ADDR'] = '127.0.0.1'\n"
        "dist.init_process_group('gloo', rank=int(os.environ['R']), world_size=3)  # INIT\n"
    )
    launcher = tmp_path / "two.py"
    launcher.write_text(
        "import os, subprocess, sys\n"
        f"procs = [subprocess.Popen([sys.executable, {str(script)!r}], env=dict(os.environ, R=str(r))) for r in (0, 1)]\n"
        "[p.wait() for p in procs]\n"
    )
    options = ("--hang-timeout", "3", "--startup-timeout", "20", "--on-hang", "kill")
    res = run_supervised(
        tmp_path, [sys.executable, str(launcher)], options=options, env={"MASTER_PORT": str(free_port())}
    )
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.startup", 2), v
    assert "never joined the process group" in v["summary"] and v["details"]["waiting_ranks"] == [0, 1], v
    assert f"called at {_line(script, '# INIT')}" in v["summary"]


WORLD_TOO_LARGE = textwrap.dedent(
    """\
    import os, pathlib, threading, time
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def note_waiting():  # for the test: a file once the ranks have waited a while
        time.sleep(4)
        pathlib.Path(os.environ["WAITED"]).touch()

    def worker(rank, world_size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        threading.Thread(target=note_waiting, daemon=True).start()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)  # INIT

    if __name__ == "__main__":
        if "RANK" in os.environ:  # under torchrun, with a world size of the script's own
            worker(int(os.environ["RANK"]), 3)
        else:
            mp.spawn(worker, args=(3,), nprocs=2)  # meant: the same number as world_size
    """
)


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_world_larger_than_the_jobs_processes_is_a_hang_at_once(tmp_path: Path, launcher: str) -> None:
    """world_size=3 with two processes: the rendezvous can never complete, so the hang is declared
    after the hang timeout, not after the start-up allowance (600 s here), and says why."""
    script = tmp_path / "world.py"
    script.write_text(WORLD_TOO_LARGE)
    job = torchrun(2, str(script)) if launcher == "torchrun" else [sys.executable, str(script)]
    options = ("--hang-timeout", "3", "--startup-timeout", "600", "--on-hang", "kill")
    env = {"MASTER_PORT": str(free_port()), "WAITED": str(tmp_path / "waited")}
    res = run_supervised(tmp_path, job, options=options, env=env, timeout=120)
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"], v["location"]) == ("hang.startup", None, _line(script, "# INIT")), v
    found = v["details"]["unreachable_world"]
    assert (found["waiting_for"], found["processes"], found["ranks"]) == (3, 2, [0, 1]), found
    assert "pass world_size=2" in v["summary"], v


def test_a_job_stopped_while_its_world_cannot_meet_says_why(tmp_path: Path) -> None:
    """The same mp.spawn job stopped with Ctrl-C before any hang timeout: the ranks never got past
    init_process_group, which the report says with the cause (not "joined a process group")."""
    script = tmp_path / "world.py"
    script.write_text(WORLD_TOO_LARGE)
    waited = tmp_path / "waited"
    env = {"MASTER_PORT": str(free_port()), "WAITED": str(waited)}
    options = ("--hang-timeout", "300", "--on-hang", "kill")
    res = run_supervised(
        tmp_path, [sys.executable, str(script)], options=options, env=env, interrupt_when_file=waited
    )
    assert res.returncode == 130, res.stderr
    (v,) = res.verdicts()
    assert (v["kind"], v["location"]) == ("hang.startup", _line(script, "# INIT")), v
    assert v["details"]["unreachable_world"]["processes"] == 2, v


def test_one_run_per_run_directory(tmp_path: Path) -> None:
    first = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), env={"STEPS": "3"})
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(first.run_dir), "--", sys.executable, "-c", "pass"],
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 2 and "--replace" in again.stderr and "Traceback" not in again.stderr
    assert json.loads((first.run_dir / "report.json").read_text())["verdicts"] == []  # untouched
    replaced = subprocess.run(
        [sys.executable, "-m", "sddoctor", "run", "--replace", "--run-dir", str(first.run_dir), "--",
         sys.executable, "-c", "pass"],
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    (aside,) = (first.run_dir / "replaced").iterdir()
    assert (aside / "ranks" / "rank-00001.jsonl").exists() and (aside / "report.json").exists()
    assert not (first.run_dir / "ranks" / "rank-00001.jsonl").exists()


def test_a_run_directory_in_use_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-m", "sddoctor", "run", "--run-dir", str(run_dir), "--", sys.executable, "-c",
         "import time; time.sleep(30)"],
        env=subprocess_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "sddoctor", "run", "--replace", "--run-dir", str(run_dir), "--",
             sys.executable, "-c", "pass"],
            env=subprocess_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert "another sddoctor run is using" in second.stderr and "Traceback" not in second.stderr
        assert (run_dir / "run.json").exists() and not (run_dir / "replaced").exists()  # nothing moved
    finally:
        holder.terminate()
        holder.wait(timeout=30)


def test_rediagnosis_of_a_graceful_stop_gives_the_live_verdict(tmp_path: Path) -> None:
    import signal

    res = run_supervised(
        tmp_path, torchrun(2, str(SCRIPT)), env={"STEPS": "400", "PAUSE": "0.05"}, options=("--hang-timeout", "30"),
        interrupt_when_ranks=2, stop_signal=signal.SIGTERM,
    )  # fmt: skip
    assert res.returncode == 143, res.stderr
    live = res.report
    again = subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", "--rediagnose", "--json", str(res.run_dir)],
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    report = json.loads(again.stdout)
    assert again.returncode == 0, again.stderr
    assert (
        (report["outcome"], report["exit_code"])
        == (live["outcome"], live["exit_code"])
        == ("interrupted", 143)
    )
    assert [v["kind"] for v in report["verdicts"]] == [v["kind"] for v in live["verdicts"]]
    assert not [v for v in report["verdicts"] if v["kind"] == "crash"]


def test_sddoctors_own_failure_in_a_rank_is_recorded_and_the_job_goes_on(tmp_path: Path) -> None:
    """A bug in sddoctor's comm hook accounting, planted through the user's own sitecustomize
    (which sddoctor's bootstrap chains): the DDP job must train to the end unaffected."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        "import sddoctor.instrument.ddp_hook as hook\n"
        "def broken(*args, **kwargs):\n"
        "    raise KeyError('planted bug')\n"
        "hook._account_launch = broken\n"
    )
    client = Path(__file__).parent / "clients" / "ddp_tutorial.py"
    res = run_supervised(
        tmp_path, torchrun(2, str(client)), env={"STEPS": "6", "PYTHONPATH": f"{plant}{os.pathsep}{REPO_ROOT}"},
        options=("--hang-timeout", "30"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "rank 0 done" in res.stdout + res.stderr + (res.run_dir / "stderr.log").read_text()
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["severity"], v["culprit_rank"]) == ("sddoctor.internal_error", "warning", None)
    assert "ddp comm hook" in v["summary"] and "planted bug" in v["summary"]
    assert res.report["outcome"] == "ok"


def test_stacks_without_an_activated_environment(tmp_path: Path) -> None:
    """The interpreter's own scripts folder holds py-spy; PATH does not name it (cron, SLURM, IDE)."""
    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "py-spy")):
        pytest.skip(f"py-spy is not installed next to {sys.executable}")
    bare_path = os.pathsep.join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))
    res = run_supervised(
        tmp_path, torchrun(2, str(SCRIPT)), fault="skip:rank=1,seq=4", env={"STEPS": "50", "PATH": bare_path}
    )
    assert res.returncode == 124, res.stderr
    assert res.report["stacks"]["problem"] is None, res.report["stacks"]
    assert (res.run_dir / "stacks" / "rank-00000.json").exists() and (
        res.run_dir / "stacks" / "rank-00001.json"
    ).exists()


def test_no_empty_files_are_left(tmp_path: Path) -> None:
    res = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), env={"STEPS": "5"})
    assert res.returncode == 0, res.stderr
    empty = [p for p in res.run_dir.rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert empty == []
