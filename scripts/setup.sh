#!/usr/bin/env bash
# Install sddoctor, the bundled trainer and their dependencies into the current Python.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --dev    plus the test and lint tools
# torch is installed first at a pinned release when it is missing; install the CUDA build you
# want before running this if you need a specific one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
target="."
[ "${1:-}" = "--dev" ] && target=".[dev]"
"$PY" -m pip install --quiet -e "$target"
