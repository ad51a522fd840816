#!/usr/bin/env bash
# The checks a lent NVIDIA GPU runs (the device tool's machine: a CUDA torch, no network, no
# vLLM): kvhal, kvhal-cuda and the conformance suite installed offline from this checkout, then
# every kept worker trace replayed on CUDA (`kvhal replay`: vLLM's connector calls, every block
# checked; docs/replay.md), the cost of a layer-by-layer load to the engine's thread
# (plugins/cuda/tools/layerwise_submit.py), the CUDA plugin's tests, the conformance suite at
# full sizes and `kvhal bench copy --device cuda`. Wheels the machine lacks travel in .whl/
# (crc32c, blake3, xxhash for its Python: `pip download --only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64 --no-deps crc32c blake3 xxhash -d .whl`). Everything
# lands in $OUT: one log (gpu-check.log), the replay's JSON, the conformance report (cuda.md,
# cuda.json), the bench's JSON and plot and the layer-by-layer tool's JSON (8 files at most
# come back).
#   run: bash scripts/gpu-check.sh [STEP ...]   (carry .whl)   STEP: replay layerwise tests
#        conformance bench (default: all of them, in that order)
set -u
OUT=${OUT:-/tmp/kvhal-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
steps=${*:-replay layerwise tests conformance bench}
step() { echo; echo "=== $* ($(date +%T))"; }
wanted() { [[ " $steps " == *" $1 "* ]]; }

step install
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .whl/*.whl . ./plugins/cuda ./conformance || exit 1
KVHAL=/tmp/site/bin/kvhal
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
$KVHAL devices

if wanted replay; then
  step replay: every kept worker trace on cuda
  timeout 240 $KVHAL replay /tmp/site/kvhal_conformance/traces/*.json.gz --device cuda \
      --json "$OUT/replay-cuda.json" 2>&1
fi

if wanted layerwise; then
  step layer-by-layer load: the submitting thread
  timeout 120 python3 plugins/cuda/tools/layerwise_submit.py cuda --json "$OUT/layerwise-cuda.json"
fi

if wanted tests; then
  step cuda plugin tests
  timeout 180 python3 -m pytest plugins/cuda/tests -q -p no:cacheprovider --timeout 120 -rs 2>&1
fi

if wanted conformance; then
  step conformance
  timeout 300 $KVHAL conformance --device cuda --report "$OUT" -q 2>&1
fi

if wanted bench; then
  step bench copy
  timeout 90 $KVHAL bench copy --device cuda --out "$OUT/bench" 2>&1
fi
step done
