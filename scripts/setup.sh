#!/usr/bin/env bash
# Install sddoctor, the bundled trainer's stack and their dependencies into the current Python.
#   scripts/setup.sh          sddoctor and the trainer (".[trainer]")
#   scripts/setup.sh --dev    plus the test, lint and type-check tools (".[trainer,dev]")
# torch is installed first at a pinned release when it is missing; install the CUDA build you
# want before running this if you need a specific one. `pip install sddoctor` alone (without
# the trainer's stack) is enough for `sddoctor run/report/tui/check-nccl/trace` on your own job.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
target=".[trainer]"
[ "${1:-}" = "--dev" ] && target=".[trainer,dev]"
"$PY" -m pip install --quiet -e "$target"
