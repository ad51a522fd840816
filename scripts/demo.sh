#!/usr/bin/env bash
# The main job (README): set up, show the selected device, run the copy benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${KVHAL_VENV:-.venv}
"$VENV/bin/kvhal" devices
"$VENV/bin/kvhal" bench copy --quick "$@"
