#!/usr/bin/env bash
# The main job (README): set up, then a real vLLM engine serving with kvhal offloading on the
# auto-selected device (here the CPU): which device plugin kvhal picked, and a table of
# time-to-first-token for a repeated long prompt (cold, vLLM prefix-cache hit, kvhal host-tier
# hit, recompute) with hit counts. Extra arguments go to `kvhal demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${KVHAL_VENV:-.venv}
"$VENV/bin/kvhal" devices
"$VENV/bin/kvhal" demo "$@"
