"""What only the supervisor knew of a run, kept in RUN_DIR/supervisor.json.

The rank files say what the ranks did; how the run ended from the outside (who stopped it and when,
the launcher's exit code and stderr, the stacks taken at a hang, the hang verdicts frozen then, the
stragglers declared, the workers that never joined) only the supervisor saw. It writes these facts
when it acts on a hang and at the end, and `apply_facts` puts them into a RunState, live or when
`sddoctor report --rediagnose` reads the run directory later (`Watcher.state(now, facts)` builds
the RunState both ways): both reach the same verdict.
"""

from __future__ import annotations

import json
from typing import Any

from sddoctor.supervise.diagnose_base import rank_exit
from sddoctor.supervise.state import RunState, Verdict
from sddoctor.telemetry import RunDir, read_json
from sddoctor.telemetry.layout import atomic_write_text

SUPERVISOR_FILE = "supervisor.json"
SCHEMA = "sddoctor.supervisor/1"


def apply_facts(state: RunState, facts: dict[str, Any]) -> None:
    """Set the supervisor's side of `state` from `facts` (a `supervisor.json` record)."""
    state.stacks_problem = facts.get("stacks_problem")
    state.flight_recorder = facts.get("flight_recorder")
    state.unjoined = [u for u in facts.get("unjoined") or [] if isinstance(u, dict)]
    state.stopped_by_supervisor = facts.get("stopped_by")
    state.stopped_at = facts.get("stopped_at")
    if isinstance(facts.get("stderr_tail"), list):
        state.stderr_tail = [str(line) for line in facts["stderr_tail"]]
    if isinstance(facts.get("launcher_failures"), list):
        state.launcher_failures = [f for f in facts["launcher_failures"] if isinstance(f, dict)]
    if isinstance(facts.get("job_exit"), dict):
        state.job_exit = facts["job_exit"]
    if isinstance(facts.get("host_oom"), dict):
        state.host_oom = facts["host_oom"]
    holders = facts.get("port_holders")
    if isinstance(holders, dict):
        state.port_holders = {str(k): v for k, v in holders.items() if isinstance(v, dict)}
    episodes = facts.get("straggler_episodes")
    if isinstance(episodes, list):
        state.straggler_episodes = [e for e in episodes if isinstance(e, dict)]
    if not state.world_size and isinstance(facts.get("world_size"), int):
        state.world_size = facts["world_size"]
    for key, exit_info in (facts.get("exits") or {}).items():
        rank = state.ranks.get(int(key)) if str(key).isdigit() else None
        if rank is not None and isinstance(exit_info, dict):
            if rank.earlier_process(exit_info.get("pid")):
                continue  # an earlier process of a restarted rank
            rank.exit = {**(rank.exit or {}), **exit_info}
            rank.alive = False
    for key, stack in (facts.get("stacks") or {}).items():
        rank = state.ranks.get(int(key)) if str(key).isdigit() else None
        if rank is not None and isinstance(stack, dict) and rank.stack is None:
            rank.stack = stack


def settle_exits(state: RunState) -> None:
    """At the end of a run: each rank's exit as best known (its own record, else the launcher's
    word, which has the real wait status), for the report."""
    for rank in state.ranks.values():
        if rank.exit is not None or any(
            f.get("rank") == rank.rank and not rank.earlier_process(f.get("pid"))
            for f in state.launcher_failures
        ):
            rank.exit = rank_exit(rank, state)


def hang_verdicts(facts: dict[str, Any]) -> list[Verdict]:
    """The hang verdicts the supervisor froze when it acted on a hang."""
    records = facts.get("hang_verdicts") or []
    return [Verdict.from_dict(d) for d in records if isinstance(d, dict) and isinstance(d.get("kind"), str)]


def read_facts(run_dir: RunDir) -> dict[str, Any] | None:
    data = read_json(run_dir.path / SUPERVISOR_FILE)
    return data if isinstance(data, dict) else None


def write_facts(run_dir: RunDir, facts: dict[str, Any]) -> None:
    atomic_write_text(
        run_dir.path / SUPERVISOR_FILE, json.dumps({"schema": SCHEMA, **facts}, indent=1, default=str)
    )
