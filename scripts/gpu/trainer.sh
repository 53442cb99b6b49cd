#!/usr/bin/env bash
# Trainer measurements on one CUDA GPU (under 5 minutes). Results under $OUT/trainer/:
#   tiny-digits-grid.png   tiny preset trained on digits: one row per digit 0-9 (learned conditioning)
#   tiny.log               its training log (loss, it/s, images/s, memory)
#   sd2-base-cached.log    SD2-base architecture, 512 px, bf16, batch 8: cached latents path
#   sd2-base-uncached.log  same with VAE + text encoder every step (diffusers train_text_to_image style)
#   summary.txt            the last progress line of each run
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/trainer"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SDDOCTOR_CACHE_DIR="$PWD/.cache/latents"
# diffusers (and anything else missing) from wheels carried in .whl/, without touching the network.
for mod in diffusers sklearn safetensors; do
    if ! "$PY" -c "import $mod" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --find-links .whl "$( [ $mod = sklearn ] && echo scikit-learn || echo $mod )" \
            || echo "could not install $mod from .whl/" | tee -a "$OUT/trainer/summary.txt"
    fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/trainer/gpu.txt"
"$PY" -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/trainer/gpu.txt"

# (a) tiny preset on digits, under `sddoctor run` on every local GPU (NCCL): long enough to learn
#     which digit a caption names. The grid has one row per prompt ("a handwritten digit zero" ...).
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || echo 1)
rm -rf runs/gpu-tiny
timeout -k 20 "${TRAINER_TINY_SECONDS:-240}" "$PY" -m sddoctor run --run-dir runs/gpu-tiny --hang-timeout 120 -- \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m trainer --set \
    train.max_steps="${TRAINER_TINY_STEPS:-2500}" train.micro_batch=256 train.log_every=250 train.ema_decay=0.999 \
    model.vae_warmup_steps=800 model.vae_warmup_batch=64 optim.lr=1e-3 optim.warmup_steps=200 \
    sample.every=500 sample.images_per_prompt=8 sample.steps=30 sample.guidance_scale=4.0 \
    2>&1 | tee "$OUT/trainer/tiny.log"
cp runs/gpu-tiny/samples/latest.png "$OUT/trainer/tiny-digits-grid.png" 2>/dev/null || echo "no tiny grid" >> "$OUT/trainer/summary.txt"
cp runs/gpu-tiny/report.md "$OUT/trainer/tiny-report.md" 2>/dev/null

if [ "${TRAINER_SD2:-1}" = 1 ]; then
# (b) SD2-base architecture (random weights), 512 px, bf16 autocast, batch 8, 20 steps; the second
#     progress line (steps 11-20) is the steady-state rate. The uncached run only if time is left.
#     Eager (model.compile=false): a 20-step smoke run would be mostly compile time; the compiled
#     speed is measured by scripts/gpu/perf.sh.
SD2=(--preset sd2-base --set data.source=digits data.resolution=512 data.max_samples=320 data.num_workers=4
     train.micro_batch=8 train.max_steps=20 train.log_every=10 train.ema_decay=0 train.mixed_precision=bf16
     optim.warmup_steps=0 sample.at_end=false checkpoint.at_end=false output.export=false model.compile=false)
timeout -k 10 100 "$PY" -m trainer --output-dir runs/gpu-sd2-cached "${SD2[@]}" data.cache=true 2>&1 | tee "$OUT/trainer/sd2-base-cached.log"
if [ "$SECONDS" -lt 215 ]; then
    timeout -k 10 $((280 - SECONDS)) "$PY" -m trainer --output-dir runs/gpu-sd2-uncached "${SD2[@]}" data.cache=false 2>&1 \
        | tee "$OUT/trainer/sd2-base-uncached.log"
else
    echo "skipped the uncached SD2 run (time)" > "$OUT/trainer/sd2-base-uncached.log"
fi

fi
for log in tiny sd2-base-cached sd2-base-uncached; do
    echo "$log: $(grep 'step ' "$OUT/trainer/$log.log" | grep 'img/s' | tail -1)" >> "$OUT/trainer/summary.txt"
done
cat "$OUT/trainer/summary.txt"
