#!/usr/bin/env bash
# GPU checks of the rank-side instrumentation (sddoctor/instrument). About 2-3 minutes (at most 4). One GPU runs all but the 2-GPU NCCL skip test.
# Results go under $OUT: CUDA tests, the overhead benchmark (gloo 2 ranks + NCCL 1 GPU), the
# hot-path microbenchmark.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sddoctor-gpu-out}
mkdir -p "$OUT"
export OMP_NUM_THREADS=4 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; } \
  > "$OUT/instrument_env.txt" 2>&1
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_instrument_cuda.py -rs \
  > "$OUT/instrument_cuda_tests.txt" 2>&1
echo "cuda tests exit $?" >> "$OUT/instrument_cuda_tests.txt"
timeout 110 python -m benchmarks.instrument_overhead --blocks 10 --steps 30 \
  > "$OUT/instrument_bench.txt" 2>&1
echo "bench exit $?" >> "$OUT/instrument_bench.txt"
timeout 40 python -m benchmarks.instrument_overhead --micro \
  > "$OUT/instrument_micro.txt" 2>&1
cat "$OUT"/instrument_*.txt
