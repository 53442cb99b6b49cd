#!/usr/bin/env bash
# Set up, then train the tiny preset on the built-in digits with 2 DDP ranks (CPU/gloo without a
# GPU, NCCL with GPUs). Output: ./runs/tiny/ (telemetry, checkpoints, samples/latest.png, export/).
# Extra arguments go to the trainer, e.g. scripts/demo.sh --set train.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m trainer "$@"
