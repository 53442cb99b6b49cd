"""The kernel's OOM-kill counters as `supervise/host_oom.py` reads them, from files laid out as the
kernel writes them (the real OOM kills are in tests/test_host_oom.py)."""

from __future__ import annotations

from pathlib import Path

from sddoctor.supervise import host_oom


def test_the_cgroup_v2_counter_is_read_from_this_processs_own_cgroup(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job-7\n")
    events = tmp_path / "fs" / "user.slice" / "job-7" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert host_oom._cgroup_events(proc, tmp_path / "fs") == events
    assert host_oom._oom_kill_count(events) == 2


def test_cgroup_v1_and_unreadable_counters_give_nothing(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/process_api/abc\n3:cpuset:/\n")
    assert host_oom._cgroup_events(proc, tmp_path) is None
    assert host_oom._oom_kill_count(tmp_path / "missing") is None
    garbled = tmp_path / "vmstat"
    garbled.write_text("nr_free_pages 12\noom_kill lots\n")
    assert host_oom._oom_kill_count(garbled) is None
