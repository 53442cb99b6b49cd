"""`sddoctor run` end to end: real gloo jobs on CPU with injected faults, checked verdict by verdict.

Every run goes through `run_supervised`, which fails the test if any process outlives sddoctor.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
from supervise_fixtures import SCRIPT, run_supervised, script_line, torchrun

from conftest import subprocess_env

COLLECTIVE = script_line("# COLLECTIVE")


def test_healthy_run_has_no_verdict(tmp_path):
    res = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), env={"STEPS": "15"})
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == []
    assert res.report["outcome"] == "ok"
    assert set(res.report["ranks"]) == {"0", "1"}
    assert "no problem found" in res.stderr


def test_skipped_collective_is_a_missing_rank_hang(tmp_path):
    res = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), fault="skip:rank=1,seq=5", env={"STEPS": "50"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert v["kind"] == "hang.missing_rank"
    assert v["culprit_rank"] == 1
    assert v["location"] == COLLECTIVE
    assert v["details"]["seq"] == 5 and v["details"]["waiting_ranks"] == [0]
    assert (res.run_dir / "stacks" / "rank-00001.json").exists()
    assert res.verdicts("crash") == []  # the ranks sddoctor killed are not crashes
    assert f"rank 1, {COLLECTIVE}" in res.stderr


def test_stalled_data_loader(tmp_path):
    res = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), env={"STEPS": "50", "DATA_STALL_RANK": "1"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.dataloader", 1)
    # the line its DataLoader worker is stuck at (the worker's stack), not the rank's next(batches)
    assert v["location"] == script_line("# a stuck read")


def test_without_stacks_the_hang_names_the_line_its_heartbeat_saw(tmp_path):
    # --on-hang wait takes no stack (as where ptrace is not permitted): the verdict names where
    # rank 1's main thread is from its last state snapshot, not its last completed collective
    res = run_supervised(
        tmp_path,
        torchrun(2, str(SCRIPT)),
        options=("--hang-timeout", "4", "--on-hang", "wait"),
        env={"STEPS": "50", "DATA_STALL_RANK": "1"},
        interrupt_when_file=tmp_path / "run" / "report.json",
    )
    live = next(line for line in res.stderr.splitlines() if "error: hang:" in line)
    assert f"its main thread is at {script_line('# DATA')} in <module>()" in live, live
    assert live.endswith(f"[{script_line('# DATA')}]"), live
    assert not list((tmp_path / "run" / "stacks").glob("rank-*"))


def test_shape_change_is_a_mismatch(tmp_path):
    res = run_supervised(tmp_path, torchrun(2, str(SCRIPT)), fault="shape:rank=1,seq=4", env={"STEPS": "50"})
    assert res.returncode != 0
    (v,) = res.verdicts("hang.")
    assert v["kind"] == "hang.mismatch"
    assert v["culprit_rank"] == 1
    assert v["location"] == COLLECTIVE
    assert res.verdicts("crash") == []  # gloo's abort on rank 0 is a consequence


def test_sigkill_names_the_rank_that_died_first(tmp_path):
    res = run_supervised(tmp_path, torchrun(3, str(SCRIPT)), fault="kill:rank=1,seq=6", env={"STEPS": "50"})
    assert res.returncode != 0
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1
    assert v["details"]["exit"]["signal"] == 9
    assert "SIGKILL" in v["summary"]
    assert sorted(v["details"]["consequences"]) == [0, 2]
    assert v["location"] == COLLECTIVE
    # `sddoctor report` on a run dir without report.json diagnoses it from the files alone.
    (res.run_dir / "report.json").unlink()
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", "--json", str(res.run_dir)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["diagnosed_offline"] is True
    assert [v["culprit_rank"] for v in report["verdicts"] if v["kind"] == "crash"] == [1]


def test_exception_is_a_crash_with_traceback(tmp_path):
    res = run_supervised(
        tmp_path, torchrun(2, str(SCRIPT)), fault="raise:rank=0,seq=3,message=boom", env={"STEPS": "50"}
    )
    assert res.returncode != 0
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 0
    assert "boom" in v["summary"]
    assert v["location"] == COLLECTIVE
    assert any(COLLECTIVE in frame for frame in v["details"]["traceback"])


def test_sleeping_rank_is_a_straggler(tmp_path):
    res = run_supervised(
        tmp_path,
        torchrun(2, str(SCRIPT)),
        fault="sleep:rank=1,seconds=0.25,seq=1,every=1",
        env={"STEPS": "28", "PAUSE": "0.01"},
        options=("--hang-timeout", "30"),
    )
    assert res.returncode == 0, res.stderr
    (v,) = res.verdicts("straggler")
    assert v["culprit_rank"] == 1
    assert v["details"]["ratio"] >= 2.0
    assert v["location"] == COLLECTIVE
    assert [x for x in res.report["verdicts"] if x["kind"] != "straggler"] == []


def test_a_straggler_the_run_outlives_too_briefly_for_py_spy_is_placed_by_its_snapshots(tmp_path):
    # about 7 s of steps: too short to confirm and sample the straggler while it runs, so the final
    # report names the line where its state snapshots saw it spend its time, not where the others wait
    res = run_supervised(
        tmp_path,
        torchrun(2, str(SCRIPT)),
        env={"STEPS": "26", "PAUSE": "0.01", "SLOW_RANK": "1"},
        options=("--hang-timeout", "30"),
    )
    assert res.returncode == 0, res.stderr
    (v,) = res.verdicts("straggler")
    assert (v["culprit_rank"], v["location"]) == (1, script_line("# SLOW_WORK")), v
    assert f"its time goes at {script_line('# SLOW_WORK')} in augment_on_the_cpu() (" in v["summary"], v
    assert v["details"]["cause"]["source"] == "snapshots", v
    assert any(e.startswith("its line is where its state snapshots") for e in v["evidence"]), v


def test_a_rank_asleep_past_the_hang_timeout_is_named_with_its_sleep(tmp_path):
    # a sleep longer than --hang-timeout is a hang, not a straggler: the sleeper is the rank the
    # others wait for, and the verdict says it sleeps in the fault rather than just naming its line
    res = run_supervised(
        tmp_path, torchrun(2, str(SCRIPT)), fault="sleep:rank=1,seconds=600,seq=6", env={"STEPS": "50"}
    )
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert v["kind"] == "hang.missing_rank" and v["culprit_rank"] == 1
    assert v["location"] == COLLECTIVE
    assert "asleep in the injected fault 'sleep:rank=1,seconds=600,seq=6'" in v["summary"]
    assert any("sleep:rank=1" in e for e in v["evidence"])


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_launch(tmp_path):
    job = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    job += ["--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT)]  # gloo on CPU
    res = run_supervised(tmp_path, job, fault="skip:rank=0,seq=3", env={"STEPS": "50"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"], v["location"]) == ("hang.missing_rank", 0, COLLECTIVE)
    assert res.report["run"]["launcher"] == "accelerate"


def test_ctrl_c_stops_the_whole_job(tmp_path):
    res = run_supervised(
        tmp_path,
        torchrun(2, str(SCRIPT)),
        env={"STEPS": "100000", "PAUSE": "0.05"},
        options=("--hang-timeout", "60"),
        interrupt_when_ranks=2,
        timeout=60,
    )
    assert res.returncode == 130
    assert res.report["outcome"] == "interrupted"
    assert res.verdicts("crash") == []
    assert len(res.seen_pids) >= 3  # the launcher and two ranks were really running


def test_sigterm_stops_the_job_with_143(tmp_path):
    ready = tmp_path / "ready"
    script = tmp_path / "long.py"
    script.write_text(f"import pathlib, time\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)\n")
    res = run_supervised(
        tmp_path,
        [sys.executable, str(script)],
        options=(),
        interrupt_when_file=ready,
        stop_signal=signal.SIGTERM,
    )
    assert res.returncode == 143
    assert res.report["outcome"] == "interrupted" and res.verdicts("crash") == []


def test_orphans_of_a_dead_launcher_are_killed(tmp_path):
    # The launcher starts a worker in a session of its own, then dies of SIGKILL: the worker is
    # re-parented to sddoctor (child subreaper) and must still be stopped.
    worker = "import os, time; os.setsid(); time.sleep(120)"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import os, signal, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
        "time.sleep(1.5)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    res = run_supervised(tmp_path, [sys.executable, str(launcher)], options=())
    assert res.returncode == 128 + 9
    assert len(res.seen_pids) >= 2  # the worker was seen, and (checked by the helper) is gone
    (v,) = res.verdicts("crash")
    assert "SIGKILL" in v["summary"]


def test_plain_python_script_crash_and_json(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import sys\nprint('working')\nraise SystemExit(3)\n")
    res = run_supervised(tmp_path, [sys.executable, str(script)], options=("--json", "--quiet"))
    assert res.returncode == 3
    report = json.loads(res.stdout[res.stdout.index("{") :])
    # no process joined a process group: no rank, and the world size is unknown, not 1
    assert report["exit_code"] == 3 and report["world_size"] is None and report["ranks"] == {}
    (v,) = report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("crash", None)
    assert "exited with code 3" in v["summary"]


def test_a_job_that_never_joins_a_process_group_is_not_called_ok(tmp_path):
    script = tmp_path / "local.py"
    script.write_text("import torch\nprint(float(torch.ones(2).sum()))\n")
    res = run_supervised(tmp_path, [sys.executable, str(script)], options=("--quiet",))
    assert res.returncode == 0, res.stderr
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["severity"]) == ("no_collectives", "info")
    assert "no process of the job joined" in v["summary"]
    assert "no problem found" not in res.stderr


def test_malformed_fault_is_a_usage_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "run", "--", sys.executable, "-c", "pass"],
        env=subprocess_env(SDDOCTOR_FAULT="skip:rank=1"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "lacks seq" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "sddoctor-runs").exists()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "no command to run"),
        (["--hang-timeout", "0", "--", "true"], 2, "must be greater than 0"),
        (["--", "no-such-launcher-xyz"], 127, "command not found"),
    ],
)
def test_usage_errors(tmp_path, args, code, message):
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "run", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == code
    assert message in out.stderr and "Traceback" not in out.stderr


def test_state_endpoint_and_report_command(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(
        "import json, os, sys, time, urllib.request\n"
        "url = json.load(open(os.path.join(os.environ['SDDOCTOR_RUN_DIR'], 'run.json')))['endpoint']\n"
        "for _ in range(50):\n"
        "    time.sleep(0.2)\n"
        "    state = json.load(urllib.request.urlopen(url + '/api/state'))\n"
        "    if state.get('ranks') is not None and state.get('run'):\n"
        "        break\n"
        "metrics = urllib.request.urlopen(url + '/metrics').read().decode()\n"
        "assert 'sddoctor_hang{node=' in metrics, metrics\n"
        "assert state['schema'] == 'sddoctor.state/1' and 'verdicts' in state, state\n"
        "assert state['run']['launcher'] == 'python', state\n"
        "print('endpoint ok')\n"
    )
    res = run_supervised(tmp_path, [sys.executable, str(script)], options=())
    assert res.returncode == 0, res.stderr
    assert "endpoint ok" in res.stdout
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", str(res.run_dir)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    # a script that joins no process group: nothing could be checked, which the report says
    assert out.returncode == 0 and "no_collectives" in out.stdout, out.stdout + out.stderr
    assert "garbled" not in out.stderr  # the report sddoctor wrote reads back cleanly


USER_HOOK_JOB = """
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(16, 4))
model.register_comm_hook(None, default_hooks.allreduce_hook)  # the program's own comm hook
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    with model.no_sync():
        model(torch.randn(8, 16)).pow(2).mean().backward()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_steps_are_inferred_through_the_programs_own_comm_hook(tmp_path):
    """A program's own comm hook stays in place, and its last bucket still ends each step: as many
    steps as optimizer steps, the last one included, with both micro-batches' samples."""
    script = tmp_path / "user_hook.py"
    script.write_text(USER_HOOK_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)))
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == []
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [(s["step"], s["grad_accum"], s.get("samples")) for s in steps] == [
            (n, 2, 16) for n in range(1, 7)
        ], steps


def test_gradient_all_reduces_on_cpu_are_timed_to_their_real_end(tmp_path):
    """DDP's bucket all-reduces are async: on gloo each one ends when its future says so, before
    the backward that waits for it, not at the next poll a second later; and a rank's time in
    collectives counts overlapping buckets once, so it stays below its wall time."""
    from sddoctor.supervise.timeline import load_timeline
    from sddoctor.telemetry import RunDir

    client = SCRIPT.parent / "clients" / "ddp_tutorial.py"
    res = run_supervised(tmp_path, torchrun(2, str(client)), env={"STEPS": "15"})
    assert res.returncode == 0, res.stderr
    timeline = load_timeline(RunDir(res.run_dir))
    for rank in (0, 1):
        lane = timeline.lanes[rank]
        buckets = sorted((c for c in lane.calls if c.op == "all_reduce"), key=lambda c: c.t0)
        assert len(buckets) == len(lane.steps) == 15  # the toy model's gradients fit one bucket
        assert all(not c.polled and c.t1 is not None for c in buckets)
        # a step's all-reduce is over before the next step's begins (optimizer.step waits for it);
        # a polled end would land up to a second later, many steps on
        for call, following in zip(buckets, buckets[1:], strict=False):
            assert call.t1 <= following.t0, (call, following)
        health = res.report["health"]["ranks"][str(rank)]
        assert 0 < health["collective_seconds"] <= health["wall_seconds"]


def test_a_rank_that_ends_early_is_named_not_the_rank_that_lost_it(tmp_path):
    """Uneven data per rank: rank 1 finishes its 6 steps and exits 0 while rank 0 goes on to the
    7th all-reduce, where gloo fails it with "Connection closed by peer". The culprit is rank 1."""
    client = SCRIPT.parent / "clients" / "ddp_tutorial.py"
    res = run_supervised(tmp_path, torchrun(2, str(client)), env={"STEPS": "12", "RANK1_STEPS": "6"})
    assert res.returncode != 0, res.stderr
    kinds = [(v["kind"], v["culprit_rank"]) for v in res.report["verdicts"]]
    assert kinds == [("exited_early", 1)], res.report["verdicts"]
    verdict = res.report["verdicts"][0]
    assert (verdict["details"]["issued"], verdict["details"]["waiting_in"]) == (6, 7)
    assert verdict["details"]["consequences"] == [0]
    assert verdict["location"] == script_line("# BACKWARD", client)
    assert "uneven data per rank" in verdict["summary"]


DATASET_JOB = """
import os, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

FAULT = os.environ["DATASET_FAULT"]


class Images(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        if i == 37 and FAULT == "raise":
            raise ValueError(f"corrupt image at index {i}")  # DATASET-ERROR
        if i == 37 and FAULT == "sleep":
            time.sleep(10_000)  # STUCK-READ
        return torch.randn(10), torch.randn(5)


dist.init_process_group("gloo")
data = Images()
loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False), num_workers=2)
model = DDP(nn.Linear(10, 5))
for x, y in loader:
    nn.functional.mse_loss(model(x), y).backward()
dist.destroy_process_group()
"""


def test_a_dataloader_worker_error_names_the_dataset_line_and_its_exception(tmp_path):
    """torch re-raises a worker's error in the rank with the worker's traceback as text: the
    verdict names the Dataset's line and the original exception, not `for x, y in loader`."""
    script = tmp_path / "dataset_job.py"
    script.write_text(DATASET_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"DATASET_FAULT": "raise"})
    assert res.returncode != 0
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 1)  # index 37 is rank 1's
    assert verdict["location"] == script_line("# DATASET-ERROR", script)
    assert "ValueError: corrupt image at index 37 in its DataLoader worker process" in verdict["summary"]
    origin = verdict["details"]["origin"]
    assert origin["exception"] == "ValueError: corrupt image at index 37"
    assert origin["traceback"][-1] == f"{script_line('# DATASET-ERROR', script)} in __getitem__"


RESTART_JOB = """
import os
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(nn.Linear(10, 5))
for step in range(8):
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1 and step == 3:
        raise RuntimeError("transient failure")  # TRANSIENT
    model(torch.randn(4, 10)).sum().backward()
dist.destroy_process_group()
"""


def test_a_run_that_torchrun_restarts_is_judged_on_its_new_processes(tmp_path):
    """torchrun --max-restarts 1: rank 1 fails on the first attempt and the workers restart. The
    first attempt's failure is a `restarted` warning naming rank 1's line; the ranks are the new
    processes. (Whether the second attempt runs is up to torchrun: on gloo its restarted ranks at
    times cannot connect, a torch issue; then that failure is the crash, judged on its own.)"""
    script = tmp_path / "restart_job.py"
    script.write_text(RESTART_JOB)
    cmd = torchrun(2, str(script))
    cmd.insert(cmd.index(str(script)), "--max-restarts=1")
    options = ("--hang-timeout", "4", "--startup-timeout", "20", "--on-hang", "kill")
    res = run_supervised(tmp_path, cmd, options=options, timeout=150)
    restarted = [v for v in res.report["verdicts"] if v["kind"] == "restarted"]
    assert [(v["severity"], v["culprit_rank"]) for v in restarted] == [("warning", 1)], res.report["verdicts"]
    verdict = restarted[0]
    assert verdict["location"] == script_line("# TRANSIENT", script)
    assert "RuntimeError: transient failure" in verdict["summary"] and verdict["details"]["attempt"] == 1
    # no verdict blames the first attempt's processes for anything else
    assert not any(
        "transient failure" in v["summary"] for v in res.report["verdicts"] if v["kind"] != "restarted"
    )
    if res.returncode == 0:
        assert [v["kind"] for v in res.report["verdicts"]] == ["restarted"]
        for rank in ("0", "1"):
            assert res.report["ranks"][rank]["exit"]["code"] == 0, res.report["ranks"][rank]


def test_a_hang_in_a_dataloader_worker_names_the_datasets_line(tmp_path):
    """Rank 1's DataLoader worker never returns from __getitem__: the rank itself only waits in
    `for x, y in loader`; the verdict names the line its worker is stuck at (the worker's stack)."""
    if shutil.which("py-spy") is None and not _py_spy_next_to_python():
        pytest.skip("py-spy is not installed")
    script = tmp_path / "dataset_job.py"
    script.write_text(DATASET_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"DATASET_FAULT": "sleep"})
    assert res.returncode == 124, res.stderr
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("hang.dataloader", 1), res.report["verdicts"]
    assert verdict["location"] == script_line("# STUCK-READ", script)
    assert "its DataLoader worker (pid" in verdict["summary"] and "__getitem__()" in verdict["summary"]
    assert list((res.run_dir / "stacks").glob("rank-00001-worker-*.txt"))


def _py_spy_next_to_python() -> bool:
    from pathlib import Path

    return (Path(sys.executable).parent / "py-spy").exists()


EXIT_JOB = """
import sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(nn.Linear(10, 5))
for step in range(8):
    if dist.get_rank() == 1 and step == 3:
        sys.exit(3)  # USER-EXIT
    model(torch.randn(4, 10)).sum().backward()
dist.destroy_process_group()
"""


def test_sys_exit_with_a_failure_status_names_its_line(tmp_path):
    """SystemExit never reaches sys.excepthook: the rank notes where its code called sys.exit(3),
    and the crash verdict names that line and the status, not its last collective's call site."""
    script = tmp_path / "exit_job.py"
    script.write_text(EXIT_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)))
    assert res.returncode != 0
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 1), res.report["verdicts"]
    assert verdict["location"] == script_line("# USER-EXIT", script)
    assert "exited with code 3" in verdict["summary"]
