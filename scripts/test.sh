#!/usr/bin/env bash
# The test command (README): set up, lint, run every test. Extra arguments go to pytest.
#   bash scripts/test.sh           every test, two workers (what CI runs via .ci/run), then the
#                                  wheels installed in a fresh venv (scripts/check-wheels.sh), then
#                                  the vllm_compat end-to-end subset on vLLM 0.27.1 in .venv-vllm0271
#   bash scripts/test.sh --quick   the inner loop before each commit: every unit test, no engine,
#                                  no conformance-suite marathon, hypothesis's quick profile
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
args=()
for arg in "$@"; do
  if [ "$arg" = --quick ]; then quick=1; else args+=("$arg"); fi
done
bash scripts/setup.sh
VENV=${KVHAL_VENV:-.venv}
echo "[test] ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check src tests conformance plugins
echo "[test] lint-imports"
"$VENV/bin/lint-imports"
# Two workers on two cores: an engine test waits on its engine's start and sleeps while a
# unit test computes. --dist loadfile keeps a file's tests (and its module-scoped servers,
# engines and the mutation batch) on one worker; files go out in the order tests/conftest.py
# gives them (the longest first), not by their number of tests.
pytest=("$VENV/bin/python" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder)
if [ "$quick" = 1 ]; then
  echo "[test] pytest (quick: not e2e, not slow)"
  KVHAL_HYPOTHESIS=quick exec "${pytest[@]}" -m "not e2e and not slow" "${args[@]}"
fi
# After every test: kvhal as shipped (the release's wheels built, installed, not editable, into
# a fresh venv beside vLLM, and an OpenAI server from that venv serving a kvhal hit;
# KVHAL_WHEEL_CHECK=0 skips it), and the vllm_compat subset (tests/e2e/conftest.py) again on
# vLLM 0.27.1, the version vllm-ascend pins, in a venv of its own (KVHAL_COMPAT_VLLM=none skips
# it; another version may be named). The wheels build, and the compat venv's torch and vLLM
# install, while the tests run: mostly unpacking and writing files, beside tests that wait on
# engines (the wheels' venv takes torch and vLLM from .venv: scripts/check-wheels.sh).
wheels=0
[ "${KVHAL_WHEEL_CHECK:-1}" != 0 ] && [ ${#args[@]} -eq 0 ] && wheels=1
compat=${KVHAL_COMPAT_VLLM:-0.27.1}
[ ${#args[@]} -eq 0 ] || compat=none
compat_venv=".venv-vllm${compat//./}"
mkdir -p .ci-logs
prepared=()
# a preparation still running when this script ends (a failure, a signal) ends with it, its pip
# included: one that outlived its run wrote into the next run's fresh venv
kill_tree() {
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
end_preparations() {
  for job in "${prepared[@]}"; do kill_tree "${job%%:*}"; done
}
trap end_preparations EXIT
if [ "$wheels" = 1 ]; then
  bash scripts/check-wheels.sh prepare >.ci-logs/wheels-prepare.log 2>&1 &
  prepared+=("$!:wheels")
fi
if [ "$compat" != none ]; then
  KVHAL_VENV=$compat_venv KVHAL_VLLM_VERSION=$compat bash scripts/setup.sh --torch-vllm-only \
    >.ci-logs/compat-prepare.log 2>&1 &
  prepared+=("$!:compat")
fi
echo "[test] pytest"
status=0
"${pytest[@]}" "${args[@]}" || status=$?
for job in "${prepared[@]}"; do
  if ! wait "${job%%:*}"; then
    echo "[test] preparing the ${job#*:} venv failed:" >&2
    tail -n 40 ".ci-logs/${job#*:}-prepare.log" >&2
    status=1
    [ "${job#*:}" = wheels ] && wheels=0
    [ "${job#*:}" = compat ] && compat=none
  fi
done
if [ "$wheels" = 1 ]; then
  echo "[test] the wheels, installed (scripts/check-wheels.sh)"
  grep -a '^\[check-wheels\]' .ci-logs/wheels-prepare.log || true
  bash scripts/check-wheels.sh run || status=$?
fi
if [ "$compat" != none ]; then
  echo "[test] vllm_compat on vLLM $compat ($compat_venv)"
  KVHAL_VENV=$compat_venv KVHAL_VLLM_VERSION=$compat bash scripts/setup.sh
  "$compat_venv/bin/python" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m vllm_compat tests/e2e \
    || status=$?
  # and the unit tests fed that version's own scheduler objects
  "$compat_venv/bin/python" -m pytest -q tests/test_vllm_versions.py tests/test_scheduler_side.py || status=$?
fi
exit $status
