#!/usr/bin/env bash
# Set up, then train the tiny preset on the built-in digits with 2 DDP ranks (CPU/gloo without a
# GPU, NCCL with GPUs) under `sddoctor run`, which traces every rank and prints its diagnosis at
# the end. Output: ./sddoctor-runs/demo-<time>/ (telemetry, report.md, checkpoints,
# samples/latest.png, export/). About 2-3 minutes on 2 CPU cores.
# Extra arguments go to the trainer, e.g. scripts/demo.sh --set train.max_steps=100
# To see a diagnosis, inject a fault: SDDOCTOR_FAULT='kill:rank=1,step=50' scripts/demo.sh
# SETUP=0 skips the install step (already installed, or running from a checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ "${SETUP:-1}" = 0 ] || bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run_dir="sddoctor-runs/demo-$(date +%Y%m%d-%H%M%S)"
status=0
"$PY" -m sddoctor run --run-dir "$run_dir" --hang-timeout 120 -- \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m trainer "$@" || status=$?
cat <<EOF

run directory: $run_dir
  report:        $PY -m sddoctor report $run_dir      (report.md there; --json for machines)
  live monitor:  $PY -m sddoctor tui --run-dir $run_dir   (run it in a second terminal during a run)
  samples:       $run_dir/samples/   exported model: $run_dir/export/
EOF
exit "$status"
