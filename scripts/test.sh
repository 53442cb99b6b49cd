#!/usr/bin/env bash
# Set up everything and run the whole test suite (lint first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --dev
"$PY" -m ruff check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
"$PY" -m pytest -q "$@"
