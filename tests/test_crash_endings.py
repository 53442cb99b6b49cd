"""How ranks end, from real runs: a job's own timeout that ends a hang before sddoctor declares it,
monitored_barrier's report, fatal signals (in the loop, and in the interpreter's shutdown after a
clean end), os._exit, and a usage error found only inside the ranks."""

from __future__ import annotations

import subprocess
import sys

from client_fixtures import CLIENTS_BY_NAME
from supervise_fixtures import run_supervised, script_line, torchrun

from sddoctor.supervise.fatal_dump import parse_fatal_dump, read_fatal_dump

ENDINGS_JOB = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist

mode = os.environ["MODE"]
timeout = datetime.timedelta(seconds=3 if mode == "pg_timeout" else 60)
dist.init_process_group("gloo", timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(1, 6):
    if step == 3 and mode == "segv_all":
        os.kill(os.getpid(), signal.SIGSEGV)  # EVERY_RANK_SEGV
    if step == 3 and rank == world - 1:
        if mode in ("pg_timeout", "monitored"):
            time.sleep(30)  # LATE
        elif mode == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)  # SEGV
        elif mode == "os_exit":
            os._exit(3)  # OS_EXIT
        elif mode == "handled":
            try:
                raise ValueError("corrupt batch")  # HANDLED
            except ValueError:
                sys.exit(1)  # the usual end of a script that reports its own errors
    if mode == "monitored":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=3))  # MONITORED
    elif mode == "wrong_op" and step == 3 and rank == world - 1:
        dist.broadcast(torch.ones(4), src=0)  # WRONG_OP
    else:
        dist.all_reduce(torch.ones(4))  # ALL_REDUCE
dist.destroy_process_group()


class AbortsWhenFreed:  # as a C++ thread that takes the GIL after Python is gone
    def __del__(self):
        os.abort()  # SHUTDOWN_ABORT


if mode == "shutdown_abort" and rank == 0:
    left_for_shutdown = AbortsWhenFreed()  # a module global: freed in the interpreter's shutdown
"""

#: --hang-timeout above the job's own 3 s timeouts: the job ends the wait, not sddoctor
_PATIENT = ("--hang-timeout", "40", "--on-hang", "kill")


def _job(tmp_path):
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS_JOB)
    return script


def test_a_process_group_timeout_shorter_than_the_hang_timeout_names_the_late_rank(tmp_path):
    """Rank 0 raises gloo's "Timed out waiting 3000ms" first; rank 1, asleep, is the culprit, placed at
    its sleep by where torchrun's SIGTERM found it (no stack was taken before the job ended)."""
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, str(script)), options=_PATIENT, env={"MODE": "pg_timeout"})
    verdicts = [(v["kind"], v["culprit_rank"]) for v in res.report["verdicts"]]
    assert verdicts == [("hang.missing_rank", 1)], res.report["verdicts"]
    verdict = res.report["verdicts"][0]
    assert verdict["details"]["ended"] == "timeout" and verdict["details"]["seq"] == 3
    assert verdict["location"] == script_line("# LATE", script), verdict  # not its last collective's line
    assert "when SIGTERM stopped it" in verdict["summary"], verdict
    assert "all_reduce #3" in verdict["summary"] and "timeout" in verdict["summary"]


def test_monitored_barrier_names_the_rank_that_did_not_arrive(tmp_path):
    """Rank 0 reports "Rank 2 failed to pass monitoredBarrier"; rank 1 fails too, naming rank 0."""
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(3, str(script)), options=_PATIENT, env={"MODE": "monitored"})
    verdicts = [(v["kind"], v["culprit_rank"]) for v in res.report["verdicts"]]
    assert verdicts == [("hang.missing_rank", 2)], res.report["verdicts"]
    assert "monitored_barrier" in res.report["verdicts"][0]["summary"]


def test_a_fatal_signal_is_located_by_the_ranks_faulthandler_dump(tmp_path):
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"MODE": "segv"})
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 1), res.report["verdicts"]
    assert verdict["location"] == script_line("# SEGV", script)
    assert verdict["details"]["fatal"]["error"] == "Segmentation fault"
    assert "rank 0 stopped as a consequence" in verdict["summary"], verdict
    assert "torch_distributed_debug" not in verdict["details"]
    assert "after_program_end" not in verdict["details"] and "program had ended" not in verdict["summary"]


def test_a_fatal_signal_in_every_rank_is_each_ranks_own_and_debug_detail_is_named(tmp_path):
    """Every rank dies of SIGSEGV at one line: none of them "stopped as a consequence". The job ran
    with TORCH_DISTRIBUTED_DEBUG=DETAIL, whose wrapper crashed DDP's construction on torch 2.13: the
    verdict says it was set."""
    script = _job(tmp_path)
    env = {"MODE": "segv_all", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    res = run_supervised(tmp_path, torchrun(2, str(script)), env=env)
    verdicts = res.report["verdicts"]
    assert [v["kind"] for v in verdicts] == ["crash"], verdicts
    verdict = verdicts[0]
    other = 1 - verdict["culprit_rank"]
    assert verdict["location"] == script_line("# EVERY_RANK_SEGV", script)
    assert verdict["details"]["same_error"] == [other], verdict
    assert f"rank {other} died of the same signal there itself" in verdict["summary"], verdict
    assert "consequence" not in verdict["summary"], verdict
    assert verdict["details"]["torch_distributed_debug"] == "DETAIL"
    assert any("TORCH_DISTRIBUTED_DEBUG=DETAIL" in line for line in verdict["evidence"]), verdict


def test_a_different_collective_under_debug_detail_is_named_from_the_wrappers_error(tmp_path):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL the last of 3 ranks broadcasts where the others
    all-reduce: torch's wrapper raises "Detected mismatch between collectives" on every rank before
    the call runs. The verdict gives each rank's op and line from those errors, and names the rank
    whose call no other rank made."""
    script = _job(tmp_path)
    env = {"MODE": "wrong_op", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    res = run_supervised(tmp_path, torchrun(3, str(script)), env=env)
    verdicts = res.report["verdicts"]
    assert [(v["kind"], v["culprit_rank"]) for v in verdicts] == [("hang.mismatch", 2)], verdicts
    verdict = verdicts[0]
    assert verdict["location"] == script_line("# WRONG_OP", script)
    assert f"rank 2: broadcast [4] at {script_line('# WRONG_OP', script)}" in verdict["summary"], verdict
    assert f"rank 0: all_reduce [4] at {script_line('# ALL_REDUCE', script)}" in verdict["summary"], verdict
    fingerprints = verdict["details"]["detail_fingerprints"]
    assert [fingerprints[r]["op"] for r in ("0", "1", "2")] == ["all_reduce", "all_reduce", "broadcast"]


def test_a_rank_that_aborts_after_its_program_ended_is_told_apart(tmp_path):
    """Rank 0 finishes, destroys its group and dies of SIGABRT in the interpreter's shutdown: the
    verdict says so, with the advice for it, and does not place it at its last collective."""
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"MODE": "shutdown_abort"})
    assert res.returncode == 1, res.stderr[-3000:]
    [verdict] = res.report["verdicts"]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 0), verdict
    assert "after its program had ended" in verdict["summary"], verdict["summary"]
    assert "last completed collective" not in verdict["summary"], verdict["summary"]
    assert verdict["location"] == script_line("# SHUTDOWN_ABORT", script), verdict  # its fatal-signal dump
    assert verdict["details"]["after_program_end"] is True
    assert any("exit event says its program ended cleanly" in e for e in verdict["evidence"]), verdict
    assert any("destroy_process_group" in e for e in verdict["evidence"]), verdict["evidence"]


def test_os_exit_writes_the_exit_and_names_its_line(tmp_path):
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"MODE": "os_exit"})
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 1), res.report["verdicts"]
    assert verdict["location"] == script_line("# OS_EXIT", script)
    exits = res.events(1, "exit")
    assert [(e["status"], e["code"]) for e in exits] == [("error", 3)]


def test_an_exception_the_program_caught_before_exiting_is_what_failed(tmp_path):
    """`except ...: sys.exit(1)`: the verdict names the exception and its line, not the exit's."""
    script = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, str(script)), env={"MODE": "handled"})
    verdict = res.report["verdicts"][0]
    assert (verdict["kind"], verdict["culprit_rank"]) == ("crash", 1), res.report["verdicts"]
    assert verdict["location"] == script_line("# HANDLED", script)
    assert "ValueError: corrupt batch" in verdict["summary"]
    assert [e.get("handled") for e in res.events(1, "exception")] == [True]


def test_a_fault_outside_the_world_of_an_mp_spawn_job_is_a_usage_error(tmp_path):
    """The world size of an mp.spawn job is known only at init_process_group: the ranks stop there
    with exit code 2, and the run is a usage error, not a crash of the rank that said so."""
    client = CLIENTS_BY_NAME["spawn"]
    res = run_supervised(tmp_path, client.command(), env=client.environment(), fault="kill:rank=5,step=2")
    assert res.returncode == 2, res.stderr
    assert (res.report["outcome"], res.report["verdicts"]) == ("usage_error", [])
    assert "outside the world of 2 rank(s)" in res.stderr
    assert "usage error" in res.stderr


def test_the_fatal_dump_of_the_thread_that_crashed_is_read(tmp_path):
    """faulthandler's real output, with another thread listed first: the "Current thread" is read,
    and of several dumps in the file (a restarted rank appends), the last."""
    dump = tmp_path / "rank.fatal"
    code = f"""
import faulthandler, os, signal, threading, time
out = open({str(dump)!r}, "a")
out.write("Fatal Python error: Aborted\\n\\nCurrent thread 0x0001 (most recent call first):\\n"
          '  File "old.py", line 1 in old\\n\\n')
out.flush()
faulthandler.enable(out, all_threads=True)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
time.sleep(0.2)
def crash():
    os.kill(os.getpid(), signal.SIGSEGV)
crash()
"""
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    found = read_fatal_dump(dump)
    assert found is not None and found.error == "Segmentation fault"
    assert found.frames[0].startswith("<string>:") and found.frames[0].endswith(" in crash")
    assert parse_fatal_dump("no dump here") is None
    assert read_fatal_dump(tmp_path / "missing.fatal") is None


def test_a_fatal_dump_without_a_current_thread_is_read_from_the_main_thread():
    """A backend's own thread aborting (gloo on a size mismatch) has no Python state: no thread is
    marked current, and the main thread, listed last, is where the program was."""
    text = (
        "Fatal Python error: Aborted\n\nThread 0x0002 (most recent call first):\n"
        '  File "/x/threading.py", line 331 in wait\n\nThread 0x0001 (most recent call first):\n'
        '  File "/x/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "train.py", line 63 in sync\n'
    )
    found = parse_fatal_dump(text)
    assert found is not None and found.frames[-1] == "train.py:63 in sync", found


def test_an_injected_fault_that_never_fired_is_said(tmp_path):
    """The run is fine, but a fault meant to test it never happened: that must not read as a pass."""
    script = _job(tmp_path)
    res = run_supervised(
        tmp_path,
        torchrun(2, str(script)),
        env={"MODE": "none"},
        fault="kill:rank=1,seq=99;sleep:rank=0,seconds=0,seq=2",
    )
    assert res.returncode == 0 and res.report["verdicts"] == [], res.stderr
    assert "the injected fault 'kill:rank=1,seq=99' never fired" in res.stderr
    assert "'sleep:rank=0,seconds=0,seq=2' never fired" not in res.stderr
    assert "never fired" in (res.run_dir / "report.md").read_text()


def test_a_kill_injected_into_an_mp_spawn_worker_is_read_as_that_signal(tmp_path):
    """sddoctor is not the parent of mp.spawn's workers: the exit status comes from the spawning
    parent's join, not from a guess ("vanished without an exit record")."""
    client = CLIENTS_BY_NAME["spawn"]
    res = run_supervised(tmp_path, client.command(), env=client.environment(), fault="kill:rank=1,step=5")
    (verdict,) = res.verdicts("crash")
    assert verdict["culprit_rank"] == 1 and verdict["location"] == client.line("# FORWARD"), verdict
    assert "killed by signal 9 (SIGKILL) (injected by SDDOCTOR_FAULT)" in verdict["summary"], verdict
    assert verdict["details"]["exit"]["signal"] == 9, verdict
    failures = {f["rank"]: f for f in res.report["launcher"]["failures"]}
    assert failures[1]["root_cause"] and failures[1]["exitcode"] == -9, failures
