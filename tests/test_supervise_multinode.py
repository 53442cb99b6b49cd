"""Two `sddoctor run` processes as two nodes on 127.0.0.1, each with one rank, joined by --peers."""

from __future__ import annotations

import json
import sys

import pytest
from supervise_fixtures import SCRIPT, run_nodes, script_line

from conftest import free_port, subprocess_env


@pytest.mark.parametrize(
    "hang_timeouts",
    [
        pytest.param((4, 4), id="same-timeout"),
        # node 1 reaches its timeout first; its --on-hang kill must wait until node 0, told of the
        # hang, has taken its own rank's stack (else node 0's rank dies of "connection closed")
        pytest.param((12, 4), id="node1-first"),
    ],
)
def test_two_nodes_share_state_and_name_the_remote_culprit(tmp_path, hang_timeouts):
    ports = [free_port(), free_port()]
    master = free_port()
    env = subprocess_env(STEPS="50", SDDOCTOR_FAULT="skip:rank=1,seq=5")
    nodes = {}
    for node in (1, 0):
        nodes[node] = [
            sys.executable, "-m", "sddoctor", "run", "--quiet", "--hang-timeout", str(hang_timeouts[node]),
            "--on-hang", "kill",
            "--port", str(ports[node]), "--peers", f"127.0.0.1:{ports[1 - node]}",
            "--run-dir", str(tmp_path / f"node{node}"), "--",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master), str(SCRIPT),
        ], env  # fmt: skip
    codes = run_nodes(tmp_path, nodes, timeout=90)
    assert codes == {0: 124, 1: 124}, (tmp_path / "node0.log").read_text()
    report = json.loads((tmp_path / "node0" / "report.json").read_text())
    assert report["scope"] == "job" and set(report["ranks"]) == {"0", "1"}
    assert report["ranks"]["1"].get("remote") is True
    (v,) = report["verdicts"]
    assert (v["kind"], v["culprit_rank"], v["location"]) == (
        "hang.missing_rank",
        1,
        script_line("# COLLECTIVE"),
    )
    assert report["ranks"]["0"]["stack"]["ok"]  # node 0 took its rank's stack before the job ended
    if hang_timeouts[0] > hang_timeouts[1]:
        assert v["details"]["declared_by_peer"] == f"127.0.0.1:{ports[1]}"
