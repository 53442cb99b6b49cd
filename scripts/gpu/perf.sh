#!/usr/bin/env bash
# Trainer speed and memory on ONE CUDA GPU, SD2-base architecture (random weights), 512 px, bf16:
# about 15 minutes in all; PERF_TABLE=0, PERF_ONOFF=0 or PERF_MAXBATCH=0 leave a section out
# (scripts/gpu/all.sh runs them as parts of under ten minutes each). Run from the repository root.
#   $OUT/perf/bench.json, bench.json.txt      the table: reference loop vs trainer variants
#   $OUT/perf/maxbatch.json, maxbatch.json.txt  largest memory-saver batch under a 24 GiB card
#   $OUT/perf/gpu.txt                          GPU, driver, torch/diffusers versions
#   $OUT/perf/logs/                            one log per case (command line first)
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/perf/logs"
WORK=/tmp/perf-work
rm -rf "$WORK" && mkdir -p "$WORK"
export SDDOCTOR_CACHE_DIR="$WORK/latents"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/perf/gpu.txt"
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/perf/gpu.txt"

# (1) the table, most important cases first; --budget skips the rest once 305 s are spent.
#   reference@B   diffusers train_text_to_image style (fp32 UNet under bf16 autocast, VAE + text
#                 encoder every step, torch AdamW, clipping)
#   default@B     the trainer as configured by its sd2-base preset (torch.compile on CUDA: about
#                 three minutes of compiling before the first fast step, so it gets a long timeout)
#   saver@4       train.memory_saver=true (goal: under 12 GiB; compiled too)
#   cached@32     the earlier anchor (97.8 images/s at batch 32): fp32 UNet under autocast, cached latents, channels_last, fused AdamW
#   bf16w@32      bf16 weights without compile (what default was before compile became the default)
if [ "${PERF_TABLE:-1}" = 1 ]; then
timeout -k 15 540 python3 -m trainer.bench --preset sd2-base --warmup 5 --steps 15 \
    --cases reference@32,default@32,saver@4,cached@32,bf16w@32,reference@16,default@48 \
    --gpu-idle --budget 420 --timeout 300 --workdir "$WORK/table" --out "$OUT/perf/bench.json"
echo "bench exit code $?" | tee -a "$OUT/perf/gpu.txt"
fi

# (1b) instrumentation on vs off on the real trainer (tracing + OOM guard), interleaved.
if [ "${PERF_ONOFF:-1}" = 1 ]; then
# Eager (model.compile=false): four compiles would not fit the time; the cost measured is the
# instrumentation's, which does not depend on compile.
timeout -k 10 200 python3 -m trainer.bench --preset sd2-base --warmup 5 --steps 15 \
    --cases default@32,uninstrumented@32,default@32,uninstrumented@32 --set model.compile=false \
    --timeout 60 --workdir "$WORK/onoff" --out "$OUT/perf/onoff.json"
echo "on/off exit code $?" | tee -a "$OUT/perf/gpu.txt"
fi

# (2) largest memory-saver batch that fits a 24 GiB card (allocator capped at 23 GiB), 4 probes.
if [ "${PERF_MAXBATCH:-1}" = 1 ]; then
timeout -k 10 130 python3 -m trainer.bench --preset sd2-base --cases none --find-max-batch 24 \
    --max-batch-variant saver --max-batch-start 8 --max-probes 4 --set model.compile=false --timeout 60 --workdir "$WORK/maxbatch" --out "$OUT/perf/maxbatch.json"
echo "max-batch exit code $?" | tee -a "$OUT/perf/gpu.txt"
fi

cp "$WORK"/*/*.log "$OUT/perf/logs/" 2>/dev/null
cat "$OUT"/perf/*.json.txt 2>/dev/null
