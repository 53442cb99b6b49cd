#!/usr/bin/env bash
# What fits a 24 GiB card (RTX 3090/4090), measured on ONE bigger CUDA GPU with PyTorch's allocator
# capped at 23 GiB (the last GiB stands for the CUDA context and library workspaces): SD2-base,
# 512 px, bf16, EMA off, torch.compile off (a compile per probe would not fit the time). About
# 8 minutes; run from the repository root.
#   (1) trainer.memory_probe: per setup, in a process of its own, the largest micro-batch that
#       trains (doubling + bisection, exact), its peak memory and images/s, and batch 4's peak:
#       saver, default, lora (rank 16), adamw8bit, gc (checkpointing), adamw8bit-gc, saver-8bit, lora-gc
#   (2) trainer.bench through the real `python -m trainer` under the same cap, at the largest batch
#       found for the memory saver and for LoRA: confirms the fit and gives the trainer's own img/s
#   $OUT/memory24/memory.json, memory.md     (1); $OUT/memory24/bench.json(.txt)  (2)
#   $OUT/memory24/gpu.txt, logs/             GPU and versions; each bench case's log
# The 8-bit AdamW rows need bitsandbytes; without it they are reported as failed rows. The machine
# may be offline: BNB_WHEEL=/path/to/bitsandbytes-*.whl installs that wheel first.
set -uo pipefail
OUT=${OUT:-./gpu-out}
DIR="$OUT/memory24"
mkdir -p "$DIR/logs"
WORK=/tmp/memory24-work
rm -rf "$WORK" && mkdir -p "$WORK"
export SDDOCTOR_CACHE_DIR="$WORK/latents" PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import bitsandbytes" 2>/dev/null && [ -n "${BNB_WHEEL:-}" ]; then
    python3 -m pip install --no-deps --no-index "$BNB_WHEEL" > "$DIR/logs/bnb-install.log" 2>&1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DIR/gpu.txt"
python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$DIR/gpu.txt"
python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1 | tee -a "$DIR/gpu.txt"

# (1) every setup, one process each; 70 s at most per setup, none started past 300 s
timeout -k 10 360 python3 -m trainer.memory_probe --preset sd2-base --card-gib 24 --timeout 70 --budget 300 \
    --out "$DIR"
echo "memory_probe exit code $?" | tee -a "$DIR/gpu.txt"

# (2) the real trainer at the largest saver and LoRA batches, under the same cap
CASES=$(python3 - "$DIR/memory.json" <<'PY'
import json, sys
try:
    rows = {r["variant"]: r for r in json.load(open(sys.argv[1]))["rows"]}
except (OSError, ValueError, KeyError):
    rows = {}
cases = [f"{v}@{rows[v]['largest_batch']}" for v in ("saver", "lora") if rows.get(v, {}).get("largest_batch")]
print(",".join(cases))
PY
)
if [ -n "$CASES" ]; then
    timeout -k 10 115 python3 -m trainer.bench --preset sd2-base --cases "$CASES" --cap-gib 24 \
        --set model.compile=false --warmup 3 --steps 6 --timeout 60 --workdir "$WORK/bench" --out "$DIR/bench.json"
    echo "bench exit code $?" | tee -a "$DIR/gpu.txt"
    cp "$WORK"/bench/*.log "$DIR/logs/" 2>/dev/null
fi
cat "$DIR/memory.md" "$DIR/bench.json.txt" 2>/dev/null
