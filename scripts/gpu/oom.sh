#!/usr/bin/env bash
# Real CUDA out-of-memory on one GPU and the OOM guard recovering from it; guard overhead on vs off.
#   OUT=/tmp/oom-results bash scripts/gpu/oom.sh
# Writes $OUT/oom_demo.json, $OUT/oom_demo.log, $OUT/run/ (telemetry events of the demo run),
# $OUT/cpu_bench/rank-*.json (2-rank gloo micro-benchmark of the control plane on this host's CPUs),
# $OUT/trainer_bench/rank-0.json and $OUT/trainer_overhead.txt (the guard's cost on the bundled
# trainer's step, on vs off, interleaved in one process). Takes about 3 minutes on an H200. Knobs: OOM_DEMO_LIMIT_GIB (default 24: a 24 GB card),
# OOM_DEMO_BATCH (per-rank batch, default 32).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./oom-gpu-results}
mkdir -p "$OUT/cpu_bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

# 1) the real OOM, the recovery and the on/off overhead (one rank, NCCL data plane + gloo control plane)
timeout 240 "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port 29561 \
    scripts/gpu/oom_demo.py --out "$OUT" 2>&1 | tee "$OUT/oom_demo.log"

# 2) cost of one control-plane agreement and of the guard per step, 2 CPU ranks (gloo), idle cores
OMP_NUM_THREADS=1 timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port 29562 \
    tests/oom_fixtures.py '{"bench": 1, "per_rank_batch": 16}' "$OUT/cpu_bench" 2>&1 | tail -5
"$PY" - "$OUT" <<'PYEOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted((out / "cpu_bench").glob("rank-*.json")):
    b = json.loads(f.read_text())["bench"]
    print(f"{f.name}: step off {b['off_ms']:.2f} ms, on {b['on_ms']:.2f} ms "
          f"({(b['on_ms'] / b['off_ms'] - 1) * 100:+.1f}%), without agreements {b['no_agree_ms']:.2f} ms, "
          f"one gloo agreement {b['agree_ms'] * 1000:.0f} us")
PYEOF

# 3) the guard's overhead on the bundled trainer's step (tiny preset, bf16, micro-batch 8 x 2, 1 GPU):
#    guard.run_step vs the plain trainer.step.run_step on the same DDP wrapper, interleaved blocks
timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port 29563 \
    tests/test_oom_trainer.py "$OUT/trainer_bench" 200 2>&1 | tail -3 | tee "$OUT/trainer_overhead.txt"
