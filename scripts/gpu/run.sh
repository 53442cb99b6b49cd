#!/usr/bin/env bash
# sddoctor run on NCCL (needs 2 GPUs, about 2-3 minutes): a healthy run, a skipped collective,
# a shape mismatch and a SIGKILL, each with its report, plus the NCCL flight recorder dump that
# sddoctor triggers on a hang. Results under $OUT/<case>/ (report.json, report.md, stacks/) and
# $OUT/summary.txt. Run from the repository root: OUT=/tmp/out bash scripts/gpu/run.sh
set -u
OUT=${OUT:-/tmp/sddoctor-gpu-run}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
SCRIPT="$OUT/nccl_job.py"
cat > "$SCRIPT" <<'PY'
import os, time
import torch, torch.distributed as dist
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank = dist.get_rank()
x = torch.ones(1 << 20, device="cuda")
for step in range(int(os.environ.get("STEPS", "200"))):
    y = x * (rank + 1)
    dist.all_reduce(y)  # COLLECTIVE
    torch.cuda.synchronize()
    time.sleep(0.01)
dist.barrier()
dist.destroy_process_group()
PY
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
{
  echo "GPUs: $NGPU; torch $(python -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  echo "py-spy: $(py-spy --version 2>&1)"
} > "$OUT/summary.txt"
if [ "$NGPU" -lt 2 ]; then echo "need 2 GPUs" >> "$OUT/summary.txt"; exit 0; fi
run_case() {
  local name=$1 fault=$2
  local t0=$(date +%s.%N)
  SDDOCTOR_FAULT="$fault" timeout 120 python -m sddoctor run --quiet --hang-timeout 10 --on-hang kill \
    --run-dir "$OUT/$name" -- torchrun --nproc-per-node 2 "$SCRIPT" > "$OUT/$name.log" 2>&1
  local rc=$?
  local t1=$(date +%s.%N)
  python - "$OUT/$name" "$name" "$rc" "$t0" "$t1" >> "$OUT/summary.txt" <<'PY'
import json, sys
d, name, rc, t0, t1 = sys.argv[1:]
try:
    r = json.load(open(f"{d}/report.json"))
except Exception as e:
    print(f"{name}: rc={rc} no report ({e})"); sys.exit()
vs = [(v["kind"], v["culprit_rank"], v["location"]) for v in r["verdicts"]]
fr = r.get("flight_recorder") or {}
print(f"{name}: rc={rc} wall={float(t1)-float(t0):.1f}s verdicts={vs} stacks={r['stacks']} "
      f"flight_recorder_ranks={sorted((fr.get('ranks') or {}).keys())}")
PY
}
run_case healthy ""
run_case skip "skip:rank=1,seq=20"
run_case shape "shape:rank=1,seq=20"
run_case kill "kill:rank=1,seq=20"
ls "$OUT"/*/stacks >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
