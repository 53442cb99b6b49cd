#!/usr/bin/env bash
# `sddoctor tui` on a CUDA machine (about 2 minutes): numbers against nvidia-smi, the cost
# benchmark (next to nvitop when it is importable), and screenshots of the real app.
# Results go under $OUT (default ./out-tui). Run from the repository root.
# Optional: WHEELS=dir of wheels (textual, nvitop) to install offline first; BENCH_SECONDS (default 10).
set -uo pipefail
OUT=${OUT:-./out-tui}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
PY=${PYTHON:-python}
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --find-links "$WHEELS" textual nvitop 2>&1 | tail -2
fi
{ nvidia-smi -L; $PY -c "import textual, sys; print('python', sys.version.split()[0], 'textual', textual.__version__)";
  $PY -c "import nvitop; print('nvitop', nvitop.__version__)" 2>/dev/null || echo "nvitop not importable"; } | tee "$OUT/env.txt"

# Start-up is timed as an installed package starts: with bytecode (some hosts set
# PYTHONDONTWRITEBYTECODE=1, and a source checkout would then compile every module at each start).
$PY -m compileall -q sddoctor > /dev/null 2>&1 || true
unset PYTHONDONTWRITEBYTECODE

RUN="$OUT/run-workload"
rm -rf "$RUN"; mkdir -p "$RUN"
$PY scripts/gpu/tui_workload.py "$RUN" 100 > "$OUT/workload.log" 2>&1 &
WL=$!
trap 'kill $WL 2>/dev/null; wait $WL 2>/dev/null' EXIT
for _ in $(seq 120); do grep -q ready "$OUT/workload.log" && break; kill -0 $WL 2>/dev/null || break; sleep 0.5; done
sleep 3  # let utilization and a few steps build up
echo "workload pid $WL"

# 1. one snapshot, and nvidia-smi's view of the same moment
GPU_FIELDS=index,uuid,name,pci.bus_id,utilization.gpu,utilization.memory,memory.used,memory.total,temperature.gpu,power.draw,power.limit,clocks.sm,clocks.mem,pstate
TIMEFORMAT="%R s wall for sddoctor tui --json"
{ time $PY -m sddoctor tui --json --run-dir "$RUN" > "$OUT/tui.json"; } 2> "$OUT/tui-json.time"
nvidia-smi --query-gpu=$GPU_FIELDS --format=csv,noheader,nounits > "$OUT/smi-gpu.csv"
nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits > "$OUT/smi-apps.csv"
nvidia-smi --query-gpu=index,clocks_event_reasons.active --format=csv > "$OUT/smi-clock-events.csv" 2>/dev/null || true
$PY -m sddoctor tui --once --run-dir "$RUN" > "$OUT/tui-once.txt"
cat "$OUT/tui-once.txt" "$OUT/tui-json.time"
echo "== sddoctor vs nvidia-smi"
$PY scripts/gpu/tui_compare.py "$OUT/tui.json" "$OUT/smi-gpu.csv" "$OUT/smi-apps.csv" | tee "$OUT/compare.txt"

# 2. cost benchmark (4 phases of 10 s at 1 Hz), workload still running
echo "== benchmark"
$PY -m benchmarks.tui_cost --seconds "${BENCH_SECONDS:-10}" --size 80x24 --size 200x50 --json "$OUT/bench.json" | tee "$OUT/bench.txt"
$PY -m benchmarks.tui_cost --seconds 5 --fake-gpus 8 --skip-app --json "$OUT/bench-fake8.json" | tee "$OUT/bench-fake8.txt"

# 3. screenshots of the real app reading the workload's run
$PY scripts/gpu/tui_screens.py "$RUN" "$OUT"
ls -la "$OUT"
