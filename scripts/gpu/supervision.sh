#!/usr/bin/env bash
# `sddoctor run` on one CUDA GPU (about 1-2 minutes): an unchanged DDP program (NCCL, 1 rank) under
# supervision, /metrics scraped while it runs (GPU gauges from NVML), then its report: steps
# inferred from DDP, GPU samples, no verdict. Results go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sddoctor-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=4
PY=${PYTHON:-python3}
JOB="$OUT/ddp_cuda.py"
cat > "$JOB" <<'PYEOF'
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(int(os.environ.get("STEPS", "300"))):
    opt.zero_grad(set_to_none=True)
    loss = model(torch.randn(256, 4096, device="cuda")).float().pow(2).mean()
    loss.backward()
    opt.step()
dist.destroy_process_group()
print("done", flush=True)
PYEOF
RUN="$OUT/run"
rm -rf "$RUN"
$PY -m sddoctor run --run-dir "$RUN" --port 0 --hang-timeout 60 -- \
    $PY -m torch.distributed.run --standalone --nproc-per-node 1 "$JOB" > "$OUT/run.stdout" 2> "$OUT/run.stderr" &
SUP=$!
for _ in $(seq 120); do grep -q '"endpoint"' "$RUN/run.json" 2>/dev/null && break; sleep 0.5; done
sleep 12
URL=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['endpoint'])" "$RUN/run.json")
curl -s "$URL/metrics" > "$OUT/metrics.txt" || $PY -c "import urllib.request,sys; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$URL/metrics" > "$OUT/metrics.txt"
wait $SUP; echo "sddoctor run exit $?" >> "$OUT/run.stderr"
grep -E "^sddoctor_(gpu|rank_step|steps|images)" "$OUT/metrics.txt" | head -30
tail -5 "$OUT/run.stderr"
$PY - "$RUN" <<'PYEOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
r = json.loads((run / "report.json").read_text())
steps = [json.loads(l) for l in (run / "ranks/rank-00000.jsonl").read_text().splitlines() if '"step"' in l]
steps = [s for s in steps if s.get("kind") == "step"]
gpus = (run / "gpus.jsonl").read_text().splitlines() if (run / "gpus.jsonl").exists() else []
print("verdicts", [v["kind"] for v in r["verdicts"]], "outcome", r["outcome"])
print("steps inferred", len(steps), "first", steps[0] if steps else None)
print("gpu samples", len(gpus))
print("health throughput", (r.get("health") or {}).get("throughput"))
PYEOF
cp "$RUN/report.md" "$OUT/report.md" 2>/dev/null
