#!/usr/bin/env bash
# The release artifacts, as shipped: a wheel and an sdist of kvhal (its C extensions compiled
# into the wheel), kvhal-cuda, kvhal-rocm, kvhal-npu and kvhal-conformance, built with
# `python -m build` (each in an isolated build environment, the wheel from the sdist).
#   bash scripts/build-wheels.sh [OUTDIR]     default: dist/ (emptied first)
# PYTHON picks the interpreter that runs `build` (default: $KVHAL_VENV/bin/python, .venv's).
# It fails when the five are not of one version, or when kvhal's wheel lacks one of its C extensions (kvhal.build_info.EXTENSIONS): a
# release without them runs the slower paths, so it is not shipped by mistake.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-${KVHAL_VENV:-.venv}/bin/python}
OUT=${1:-dist}
rm -rf "$OUT"
mkdir -p "$OUT"
for project in . plugins/cuda plugins/rocm plugins/npu conformance; do
  echo "[build-wheels] $project"
  "$PY" -m build --outdir "$OUT" "$project" >"$OUT/.build.log" 2>&1 || {
    cat "$OUT/.build.log" >&2
    echo "[build-wheels] building $project failed" >&2
    exit 1
  }
done
rm -f "$OUT/.build.log"
# kvhal's wheel holds every C extension, for the interpreter that built it
"$PY" - "$OUT" <<'EOF'
import sys
import zipfile
from pathlib import Path

from kvhal.build_info import EXTENSIONS

out = Path(sys.argv[1])
wheels = sorted(out.glob("kvhal-[0-9]*.whl"))
assert len(wheels) == 1, f"one kvhal wheel expected in {out}, found {wheels}"
names = zipfile.ZipFile(wheels[0]).namelist()
missing = [
    ext.module for ext in EXTENSIONS
    if not any(n.startswith(ext.module.replace(".", "/") + ".") and n.endswith(".so") for n in names)
]
if missing:
    sys.exit(f"[build-wheels] {wheels[0].name} lacks the C extensions {missing}: see the build's log")
print(f"[build-wheels] {wheels[0].name}: {len(EXTENSIONS)} of {len(EXTENSIONS)} C extensions built")
# one version for the five (docs/release.md: it is written in six places)
versions = {p.name.split("-")[1] for p in out.glob("*.whl")}
if len(versions) != 1 or len(list(out.glob("*.whl"))) != 5:
    sys.exit(f"[build-wheels] five wheels of one version expected, found {sorted(p.name for p in out.glob('*.whl'))}")
EOF
ls -1 "$OUT"
