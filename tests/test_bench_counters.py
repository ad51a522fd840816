"""The benches read kvhal's counters as a scenario's ``metrics`` step has them: per-tier ones
labelled with the tier (``vllm:kvhal_tier_hit_tokens{tier=disk}``)."""

from __future__ import annotations

from kvhal.bench.chat.engines import round_tiers
from kvhal.bench.counters import by_tier, kvhal_counters, store_tier, tiers

METRICS = {
    "vllm:kvhal_hit_tokens": 96.0,
    "vllm:kvhal_tier_hit_tokens{tier=disk}": 32.0,
    "vllm:kvhal_tier_hit_tokens{tier=redis}": 48.0,
    "vllm:kvhal_tier_loaded_blocks{tier=redis}": 3.0,
    "vllm:prompt_tokens": 500.0,
}


def test_one_tiers_counters_by_family_beside_the_engine_wide_ones():
    assert kvhal_counters(METRICS, "redis") == {
        "hit_tokens": 96.0,
        "tier_hit_tokens": 48.0,
        "tier_loaded_blocks": 3.0,
    }
    assert kvhal_counters(METRICS, "disk") == {"hit_tokens": 96.0, "tier_hit_tokens": 32.0}
    assert kvhal_counters(METRICS) == {"hit_tokens": 96.0}


def test_a_family_by_tier_and_the_tiers_counted():
    assert by_tier(METRICS, "tier_hit_tokens") == {"disk": 32.0, "redis": 48.0}
    assert by_tier(METRICS, "tier_probes") == {}
    assert tiers(METRICS) == {"disk", "redis"}


def test_a_store_counts_under_its_urls_scheme():
    assert store_tier("redis://127.0.0.1:6379/0") == "redis"
    assert store_tier("redis+cluster://127.0.0.1:7000") == "redis+cluster"
    assert store_tier("mooncake://h:50051?metadata=http://h:8080/metadata") == "mooncake"


def test_the_chat_bench_splits_a_rounds_hits_between_the_tier_below_and_the_store():
    requests = [{"prompt_tokens": 200, "num_cached_tokens": 150, "kvhal_loaded_tokens": 120}]
    before = {"vllm:kvhal_tier_hit_tokens{tier=redis}": 10.0}
    after = {
        "vllm:kvhal_tier_hit_tokens{tier=redis}": 40.0,
        "vllm:kvhal_tier_hit_tokens{tier=disk}": 16.0,
        "vllm:kvhal_tier_dropped_blocks{tier=redis}": 2.0,
    }
    split = round_tiers(requests, after, before, store="redis")
    assert (split["disk"], split["remote"], split["host"]) == (16.0, 30.0, 120 - 16 - 30)
    assert split["remote_dropped_blocks"] == 2.0
    # an engine without a store: every tier below is the disk's column
    alone = round_tiers(requests, after, before)
    assert (alone["disk"], alone["remote"]) == (46.0, 0)
