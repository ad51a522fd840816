#!/usr/bin/env bash
# The test command (README): set up, lint, run every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${KVHAL_VENV:-.venv}
echo "[test] ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check src tests conformance plugins
echo "[test] lint-imports"
"$VENV/bin/lint-imports"
echo "[test] pytest"
exec "$VENV/bin/python" -m pytest -q "$@"
