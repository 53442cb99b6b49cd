#!/usr/bin/env bash
# Every GPU measurement the docs quote, in three parts that each fit in ten minutes on one GPU.
#   bash scripts/gpu/all.sh part1 OUTDIR   trainer (tiny on digits), OOM guard, check-nccl, tui, instrumentation
#   bash scripts/gpu/all.sh part2 OUTDIR   trainer speed and memory bench (SD2-base, 512 px)
#   bash scripts/gpu/all.sh part3 OUTDIR   instrumentation on vs off on the SD2-base trainer, and the
#                                          largest memory-saver batch under 24 GiB
# Each area's results go to OUTDIR/<area>/ and its log to OUTDIR/<area>.log; a step that runs past
# its time limit is stopped so the others still run.
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:?part1, part2 or part3}
RES=${2:?output folder}
mkdir -p "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Some scripts call `python`; make it the interpreter that has torch.
if ! command -v python >/dev/null 2>&1; then
    mkdir -p /tmp/sddoctor-bin && ln -sf "$(command -v python3)" /tmp/sddoctor-bin/python
    export PATH="/tmp/sddoctor-bin:$PATH"
fi
export PYTHON=${PYTHON:-python3}

step() {  # step NAME SECONDS SCRIPT
    local name=$1 limit=$2 script=$3 t0=$SECONDS
    mkdir -p "$RES/$name"
    OUT="$RES/$name" timeout -k 10 "$limit" bash "$script" > "$RES/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$RES/steps.txt"
}

nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
case "$part" in
    part1)
        TRAINER_SD2=0 step trainer 185 scripts/gpu/trainer.sh
        step oom 120 scripts/gpu/oom.sh
        step preflight 75 scripts/gpu/preflight.sh
        step tui 100 scripts/gpu/tui.sh
        step instrument 90 scripts/gpu/instrument.sh
        ;;
    part2)
        PERF_ONOFF=0 PERF_MAXBATCH=0 step perf 560 scripts/gpu/perf.sh
        ;;
    part3)
        PERF_TABLE=0 step perf-onoff 360 scripts/gpu/perf.sh
        ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
esac
cat "$RES/steps.txt"
