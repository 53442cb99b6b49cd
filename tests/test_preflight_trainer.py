"""The trainer's start-up preflight (`trainer.train.preflight_warnings`): check-nccl's checks on
local rank 0, printed and recorded as `warning` events, never fatal, skippable."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import subprocess_env

# Three calls in one process (importing the trainer costs seconds): local rank 0 with a session,
# local rank 1, and local rank 0 with SDDOCTOR_PREFLIGHT=0. Each prints a marker first.
SCRIPT = r"""
import os, sys
from sddoctor.instrument import api as sdi
from trainer.train import preflight_warnings

sdi.enable(sys.argv[1], rank=0, local_rank=0, world_size=1, trace=False)
for case, env in (("rank0", {"LOCAL_RANK": "0"}), ("rank1", {"LOCAL_RANK": "1"}),
                  ("off", {"LOCAL_RANK": "0", "SDDOCTOR_PREFLIGHT": "0"})):
    os.environ.update(env)
    print(f"== {case}", file=sys.stderr, flush=True)
    preflight_warnings()
sdi.disable()
print("survived")
"""


def test_trainer_preflight_prints_and_records_findings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=subprocess_env(NCCL_SOCKET_IFNAME="nosuch0", NCCL_P2P_DISABEL="1", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr
    sections = dict(part.split("\n", 1) for part in proc.stderr.split("== ")[1:])
    assert "nccl.env.ifname_missing" in sections["rank0"] and "nccl.env.misspelled" in sections["rank0"]
    assert "FAIL" in sections["rank0"] and "SDDOCTOR_PREFLIGHT=0" in sections["rank0"]
    assert sections["rank1"].strip() == "" and sections["off"].strip() == ""
    events = [json.loads(line) for line in (tmp_path / "ranks" / "rank-00000.jsonl").read_text().splitlines()]
    warnings = {e["code"]: e for e in events if e["kind"] == "warning"}
    assert set(warnings) == {"nccl.env.ifname_missing", "nccl.env.misspelled"}  # once: rank 0 only
    assert warnings["nccl.env.ifname_missing"]["severity"] == "fail"
    assert warnings["nccl.env.misspelled"]["source"] == "preflight"
    assert "NCCL_P2P_DISABLE" in warnings["nccl.env.misspelled"]["remedy"]
