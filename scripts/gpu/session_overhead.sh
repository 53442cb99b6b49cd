#!/usr/bin/env bash
# The overhead measurements of the rank-side instrumentation on the GPU machine (quieter than a
# 2-core VM): the CUDA tests, session on vs off (gloo 2 ranks + NCCL 1 GPU), an unchanged DDP
# program's comm hook and step inference on vs off, the per-call micro-benchmark. $OUT gets the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sddoctor-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4
PY=${PYTHON:-python3}
bash scripts/gpu/instrument.sh
timeout 120 $PY -m benchmarks.instrument_overhead --unchanged --blocks 12 --steps 30 > "$OUT/instrument_unchanged.txt" 2>&1
echo "unchanged exit $?" >> "$OUT/instrument_unchanged.txt"
cat "$OUT/instrument_unchanged.txt"
