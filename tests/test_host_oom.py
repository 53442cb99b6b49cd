"""The kernel's OOM killer, for real: rank 1 of a 2-rank gloo job moves into a memory cgroup with a
small limit and runs out of host memory there, itself or in its DataLoader worker. The crash
verdict says the OOM killer ended it, from the kernel's log and counters (`supervise/host_oom.py`).

Needs root and a writable cgroup v1 memory hierarchy (the CI machines have both); skipped elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = CLIENTS / "host_oom.py"
LIMIT = 256 * 2**20


def _own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, if there is one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return folder if (folder / "memory.limit_in_bytes").exists() else None
    return None


@pytest.fixture
def small_cgroup() -> Iterator[Path]:
    parent = _own_memory_cgroup()
    if os.geteuid() != 0 or parent is None:
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    folder = parent / f"sddoctor-test-{os.getpid()}"
    try:
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(LIMIT))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield folder
    finally:
        for pid in (folder / "cgroup.procs").read_text().split():  # none once the job has ended
            (parent / "cgroup.procs").write_text(pid)
        folder.rmdir()


@pytest.mark.parametrize(("where", "marker"), [("rank", None), ("worker", "# LOADER")])
def test_a_rank_the_oom_killer_ends_is_said_to_have_run_out_of_host_memory(
    tmp_path: Path, small_cgroup: Path, where: str, marker: str | None
) -> None:
    pause = "0.2" if where == "rank" else "0"  # the rank fills its memory over about 3 s
    res = run_supervised(
        tmp_path,
        torchrun(2, str(SCRIPT)),
        options=("--hang-timeout", "20", "--on-hang", "kill"),
        env={"OMP_NUM_THREADS": "1", "OOM_IN": where, "OOM_CGROUP": str(small_cgroup), "FILL_PAUSE": pause},
        timeout=150,
    )
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.verdicts()
    assert (v["kind"], v["culprit_rank"]) == ("crash", 1), v
    found = v["details"]["host_oom"]
    assert found["kills"] >= 1, found
    assert any("the kernel's OOM killer ends a process" in line for line in v["evidence"]), v
    if where == "rank":
        assert "killed by signal 9 (SIGKILL)" in v["summary"], v
        assert "; the kernel's OOM killer killed it: the host ran out" in v["summary"], v
        # No code runs at SIGKILL: the rank's last snapshot, taken while it filled memory for
        # seconds, says where its main thread was
        assert (
            "; its main thread was at " in v["summary"] and "in use_memory_until_killed() " in v["summary"]
        ), v
        assert v["location"].startswith(f"{SCRIPT}:"), v
        if found["killed"] is not None:  # the kernel log could be read: it names the rank's pid
            assert str(found["pid"]) in found["killed"], found
    else:
        assert v["location"] == script_line(marker, SCRIPT), v
        assert "the kernel's OOM killer killed its DataLoader worker (pid " in v["summary"], v
        (worker,) = found["dataloader_workers"]
        assert str(worker) in found["killed"], found
