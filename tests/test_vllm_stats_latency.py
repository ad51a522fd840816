"""Histograms and gauges of kvhal's stats (issue 37): how they travel in ``KVHALStats.data``
(a histogram's observations as a list that aggregates by concatenation, a gauge's last value)
and how KVHALPromMetrics exports them, with vLLM 0.27.1's metric classes missing or not."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvhal.vllm.stats import BUCKETS, KVHALStats, tier_key
from tests.test_vllm_stats import prom_metrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(
        f"vllm:kvhal_{name}", {"model_name": "tiny-model", "engine": "0", **labels}
    )


def test_histograms_concatenate_and_gauges_keep_the_last_value():
    worker0, worker1, scheduler = KVHALStats(), KVHALStats(), KVHALStats()
    worker0.observe("tier_read_seconds", "disk", 0.002)
    worker1.observe("tier_read_seconds", "disk", 0.004)
    scheduler.set_gauge(tier_key("tier_used_bytes", "disk"), 100)
    scheduler.add("hit_tokens", 32)
    merged = worker0.aggregate(worker1).aggregate(scheduler)
    later = KVHALStats()
    later.set_gauge(tier_key("tier_used_bytes", "disk"), 0)
    merged.aggregate(later)
    assert merged.data == {
        "tier_read_seconds{tier=disk}": [0.002, 0.004],
        "tier_used_bytes{tier=disk}": 0,  # the newer report, not 100 + 0
        "hit_tokens": 32,
    }
    assert merged.reduce()["tier_read_seconds{tier=disk}_count"] == 2
    assert merged.reduce()["tier_read_seconds{tier=disk}_mean_ms"] == 3.0


def test_a_gauge_back_to_zero_is_news():
    stats = KVHALStats()
    stats.set_gauge(tier_key("tier_inflight_bytes", "redis"), 0)
    assert not stats.is_empty()  # else the step carrying it would not be sent
    assert stats.take() is not None and stats.is_empty()


def test_prometheus_histogram_and_gauges_by_tier():
    registry = CollectorRegistry()
    metrics = prom_metrics(registry)
    stats = KVHALStats()
    for seconds in (0.00002, 0.003, 0.003, 2.0):
        stats.observe("tier_read_seconds", "disk", seconds)
    stats.observe("device_load_seconds", "host", 0.0004)
    stats.set_gauge("host_used_slots", 12)
    stats.set_gauge(tier_key("tier_up", "redis"), 1)
    metrics.observe(stats.take().data)
    assert value(registry, "tier_read_seconds_count", tier="disk") == 4
    assert abs(value(registry, "tier_read_seconds_sum", tier="disk") - 2.00602) < 1e-9
    assert value(registry, "tier_read_seconds_bucket", tier="disk", le="5e-05") == 1
    assert value(registry, "tier_read_seconds_bucket", tier="disk", le="0.005") == 3
    assert value(registry, "tier_read_seconds_bucket", tier="disk", le=str(BUCKETS[-1])) == 4
    assert value(registry, "device_load_seconds_count", tier="host") == 1
    assert value(registry, "host_used_slots") == 12
    assert value(registry, "tier_up", tier="redis") == 1
    down = KVHALStats()
    down.set_gauge(tier_key("tier_up", "redis"), 0)
    metrics.observe(down.data)
    assert value(registry, "tier_up", tier="redis") == 0
    assert value(registry, "tier_read_seconds_count", tier="disk") == 4  # not observed again


def test_a_vllm_without_gauges_or_histograms_keeps_the_counters():
    """An older vLLM's metric types without a Gauge or Histogram entry: counters only."""
    registry = CollectorRegistry()
    metrics = prom_metrics(registry)
    metrics._families = {k: v for k, v in metrics._families.items() if not k.endswith(("_seconds", "_bytes"))}
    metrics._families.pop("tier_up")
    stats = KVHALStats()
    stats.observe("tier_read_seconds", "disk", 0.1)
    stats.set_gauge(tier_key("tier_up", "redis"), 1)
    stats.add("hit_tokens", 5)
    metrics.observe(stats.data)
    assert value(registry, "hit_tokens_total") == 5
    assert value(registry, "tier_up", tier="redis") is None


def test_a_tiers_first_report_shows_each_of_its_counters_at_zero():
    """A failure's rate is 0, not absent, before its first failure (a dashboard's panel)."""
    registry = CollectorRegistry()
    metrics = prom_metrics(registry)
    stats = KVHALStats()
    stats.observe("tier_write_seconds", "host", 0.01)
    stats.add_tier("tier_written_blocks", "disk", 3)
    metrics.observe(stats.data)
    assert value(registry, "tier_written_blocks_total", tier="disk") == 3
    assert value(registry, "tier_corrupt_blocks_total", tier="disk") == 0
    assert value(registry, "tier_corrupt_blocks_total", tier="redis") is None  # never reported
    assert value(registry, "tier_corrupt_blocks_total", tier="host") is None  # counts nothing
