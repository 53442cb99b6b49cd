#!/usr/bin/env bash
# Set up everything and run the whole test suite (lint, types and import rules first): the suite,
# then the slow group. Extra arguments go to one pytest run instead (e.g. a file, -m 'not slow').
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh --dev
# report.html is tested in a real headless Chromium (Debian's package; Playwright's own browser
# download needs a network that CI does not have). Installed when missing and we are root.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "scripts/test.sh: could not install chromium; the browser tests will say they were skipped" >&2
fi
"$PY" -m ruff check .
"$PY" -m mypy            # sddoctor/, trainer/, benchmarks/ (pyproject.toml [tool.mypy]: strict on telemetry and the diagnosis)
lint-imports             # the import rules of docs/architecture.md (pyproject.toml [tool.importlinter])
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# pytest exits 5 when it collected no test: that is a failure here, not a pass.
if [ "$#" -gt 0 ]; then
    "$PY" -m pytest -q "$@"
    exit
fi
# The suite (about 13 minutes on 2 CPU cores), then the slow group: the real-client programs
# under every fault, the trainer's long runs, start-up hangs (about 20 minutes more). Both always run.
status=0
"$PY" -m pytest -q -m "not slow" || status=$?
"$PY" -m pytest -q -m slow || status=$?
exit "$status"
