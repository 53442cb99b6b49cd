#!/usr/bin/env bash
# check-nccl on a GPU machine: default run (human + JSON), --quick timing, the CUDA tests, and an
# independent all-reduce benchmark for comparison when there are 2+ GPUs. Results go to $OUT.
# Typically 1-2 minutes; every step has a timeout, 255 s at the very worst. Usage: OUT=/some/dir bash scripts/gpu/preflight.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to a results folder}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi; nvidia-smi topo -m; nvidia-smi topo -p2p r; } > "$OUT/nvidia-smi.txt" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
log "GPUs: $NGPU"

start=$(date +%s%N)
timeout 50 "$PY" -m sddoctor check-nccl --all --color never --timeout 35 > "$OUT/check-nccl.txt" 2>&1
rc=$?
log "check-nccl (default sweep): exit $rc in $(( ($(date +%s%N) - start) / 1000000 )) ms"

start=$(date +%s%N)
timeout 35 "$PY" -m sddoctor check-nccl --quick --json --timeout 25 > "$OUT/check-nccl-quick.json" 2> "$OUT/check-nccl-quick.err"
rc=$?
log "check-nccl --quick --json: exit $rc in $(( ($(date +%s%N) - start) / 1000000 )) ms"

timeout 50 "$PY" -m sddoctor check-nccl --json --timeout 35 --sizes 1M,16M,128M,512M > "$OUT/check-nccl.json" 2> "$OUT/check-nccl.err"
log "check-nccl --json --sizes 1M,16M,128M,512M: exit $?"

timeout 75 "$PY" -m pytest -q -m cuda tests/test_preflight_gpu.py > "$OUT/pytest-cuda.txt" 2>&1
log "pytest -m cuda tests/test_preflight_gpu.py: exit $? ($(tail -1 "$OUT/pytest-cuda.txt"))"

if [ "$NGPU" -ge 2 ]; then
  timeout 45 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    scripts/gpu/allreduce_reference.py 1 16 128 512 > "$OUT/reference-allreduce.txt" 2>&1
  log "reference all_reduce benchmark: exit $?"
  grep -A8 'collective test' "$OUT/check-nccl.txt" | tee -a "$OUT/summary.txt"
  grep -v '^W' "$OUT/reference-allreduce.txt" | tail -6 | tee -a "$OUT/summary.txt"
else
  log "one GPU: no reference all-reduce (busbw is 0 by definition with one rank)"
  grep -A6 'collective test' "$OUT/check-nccl.txt" | tee -a "$OUT/summary.txt"
fi
