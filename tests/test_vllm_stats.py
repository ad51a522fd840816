"""kvhal's counters for vLLM: engine-wide ones by name, per-tier ones as one family each with
the tier's name as its label, summed across workers, one Prometheus counter per family; and
the docs' counter table is the code's."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvhal.tiers.backend import ReadOutcome
from kvhal.vllm.prom_metrics import KVHALPromMetrics
from kvhal.vllm.stats import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    READ_FAILURE_COUNTERS,
    TENANT_COUNTERS,
    TIER_COUNTERS,
    TIER_GAUGES,
    KVHALStats,
    split_key,
    tenant_key,
    tier_key,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "vllm-integration.md"


def test_a_tier_counter_is_its_family_labelled_with_the_tier():
    stats = KVHALStats()
    stats.add_tier("tier_hit_tokens", "disk", 16)
    stats.add_tier("tier_hit_tokens", "disk", 8)
    stats.add_tier("tier_hit_tokens", "redis", 4)
    stats.add("hit_tokens", 28)
    stats.add_tier("tier_probes", "disk", 0)  # nothing counted: no key
    assert stats.data == {
        "tier_hit_tokens{tier=disk}": 24,
        "tier_hit_tokens{tier=redis}": 4,
        "hit_tokens": 28,
    }
    assert tier_key("tier_hit_tokens", "disk") == "tier_hit_tokens{tier=disk}"


@given(st.sampled_from(sorted(TIER_COUNTERS)), st.text())
def test_a_tier_key_splits_back_into_its_family_and_tier(family, tier):
    assert split_key(tier_key(family, tier)) == (family, tier)


@pytest.mark.parametrize("name", [*COUNTERS, "tier_hit_tokens", "tier_hit_tokens{tier=", "x{tier=disk"])
def test_a_name_without_a_tier_label_is_engine_wide(name):
    assert split_key(name) == (name, None)


def test_unknown_counters_and_families_are_refused():
    stats = KVHALStats()
    with pytest.raises(KeyError):
        stats.add_tier("tier_bogus_blocks", "disk", 1)
    with pytest.raises(KeyError):
        stats.add_tier("hit_tokens", "disk", 1)  # engine-wide: no tier
    with pytest.raises(KeyError):
        stats.add("tier_hit_tokens", 1)  # a family: only with its tier
    with pytest.raises(KeyError):
        stats.add("remote_hit_tokens", 1)  # kvhal 0.1's name
    with pytest.raises(ValueError, match="unknown kvhal counters"):
        KVHALStats(data={"tier_bogus_blocks{tier=disk}": 1})
    with pytest.raises(ValueError, match="unknown kvhal counters"):
        KVHALStats(data={"hit_tokens{tier=disk}": 1})
    assert stats.data == {}


def test_every_failed_read_outcome_has_its_family():
    failures = {outcome.value for outcome in ReadOutcome} - {ReadOutcome.OK.value}
    assert set(READ_FAILURE_COUNTERS) == failures
    assert set(READ_FAILURE_COUNTERS.values()) <= set(TIER_COUNTERS)
    # a str enum: the outcome itself finds its family
    assert READ_FAILURE_COUNTERS[ReadOutcome.CORRUPT] == "tier_corrupt_blocks"


def test_two_workers_stats_add_up_tier_by_tier():
    rank0, rank1 = KVHALStats(), KVHALStats()
    rank0.add_tier("tier_read_bytes", "disk", 100)
    rank0.add_tier("tier_read_bytes", "redis", 7)
    rank0.add("loaded_bytes", 50)
    rank1.add_tier("tier_read_bytes", "disk", 200)
    rank1.add_tier("tier_io_errors", "redis", 1)
    # as vLLM hands them over: the data dict of another process's stats
    total = KVHALStats().aggregate(rank0).aggregate(KVHALStats(data=dict(rank1.data)))
    assert total.reduce() == {
        "tier_read_bytes{tier=disk}": 300,
        "tier_read_bytes{tier=redis}": 7,
        "tier_io_errors{tier=redis}": 1,
        "loaded_bytes": 50,
    }
    taken = total.take()
    assert taken is not None and taken.data["tier_read_bytes{tier=disk}"] == 300
    assert total.is_empty() and total.take() is None


def prom_metrics(registry: CollectorRegistry, engines: int = 1) -> KVHALPromMetrics:
    """As vLLM's ``KVConnectorProm`` builds it: prometheus_client's classes, vLLM's labels
    (on a registry of the test's own, not the process's)."""
    metric_types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    per_engine = {e: ["tiny-model", str(e)] for e in range(engines)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    return KVHALPromMetrics(vllm_config, metric_types, ["model_name", "engine"], per_engine)  # type: ignore[arg-type]


def sample(registry: CollectorRegistry, name: str, engine: int = 0, **labels: str) -> float | None:
    return registry.get_sample_value(
        f"vllm:kvhal_{name}_total", {"model_name": "tiny-model", "engine": str(engine), **labels}
    )


def test_prometheus_has_one_counter_per_family_and_one_child_per_tier():
    registry = CollectorRegistry()
    metrics = prom_metrics(registry, engines=2)
    stats = KVHALStats()
    stats.add("hit_tokens", 48)
    stats.add_tier("tier_hit_tokens", "disk", 32)
    stats.add_tier("tier_hit_tokens", "redis", 16)
    metrics.observe(stats.reduce(), engine_idx=0)
    stats.reset()
    stats.add_tier("tier_hit_tokens", "disk", 8)
    stats.add_tier("tier_written_blocks", "redis+cluster", 3)
    metrics.observe(stats.reduce(), engine_idx=0)
    metrics.observe({tier_key("tier_hit_tokens", "disk"): 5}, engine_idx=1)

    assert sample(registry, "hit_tokens") == 48
    assert sample(registry, "tier_hit_tokens", tier="disk") == 40
    assert sample(registry, "tier_hit_tokens", tier="redis") == 16
    assert sample(registry, "tier_written_blocks", tier="redis+cluster") == 3
    assert sample(registry, "tier_hit_tokens", engine=1, tier="disk") == 5
    assert sample(registry, "tier_hit_tokens", engine=1, tier="redis") is None  # never counted there
    families = {m.name: m for m in registry.collect()}
    # one family per name, its children told apart by the tier label
    hits = families["vllm:kvhal_tier_hit_tokens"]
    totals = {
        (s.labels["engine"], s.labels["tier"]): s.value for s in hits.samples if s.name.endswith("_total")
    }
    # redis+cluster's from 0 since its first report, of another family (issue 37)
    assert totals == {("0", "disk"): 40, ("0", "redis"): 16, ("0", "redis+cluster"): 0, ("1", "disk"): 5}
    assert not any(name.startswith("vllm:kvhal_tier_hit_tokens{") for name in families)
    every = (*COUNTERS, *TIER_COUNTERS, *TENANT_COUNTERS, *HISTOGRAMS, *GAUGES, *TIER_GAUGES)
    assert set(families) == {f"vllm:kvhal_{name}" for name in every}


def test_prometheus_has_a_child_per_tenant_and_none_for_a_tenant_not_counted():
    registry = CollectorRegistry()
    metrics = prom_metrics(registry)
    stats = KVHALStats()
    stats.add_tenant("tenant_hit_tokens", "1f2e3d4c", 32)
    stats.add_tenant("tenant_hit_tokens", "other", 8)
    stats.add_tenant("tenant_stored_bytes", "1f2e3d4c", 4096)
    stats.add("hit_tokens", 48)
    metrics.observe(stats.reduce(), engine_idx=0)
    metrics.observe({tenant_key("tenant_hit_tokens", "1f2e3d4c"): 4}, engine_idx=0)
    assert sample(registry, "tenant_hit_tokens", tenant="1f2e3d4c") == 36
    assert sample(registry, "tenant_hit_tokens", tenant="other") == 8
    assert sample(registry, "tenant_stored_bytes", tenant="1f2e3d4c") == 4096
    assert sample(registry, "tenant_lookup_tokens", tenant="1f2e3d4c") is None  # never counted
    assert sample(registry, "hit_tokens") == 48
    families = {m.name: m for m in registry.collect()}
    samples = families["vllm:kvhal_tenant_hit_tokens"].samples
    assert {s.labels["tenant"] for s in samples} == {"1f2e3d4c", "other"}
    assert all("tier" not in s.labels for s in samples)


def test_prometheus_skips_what_it_does_not_know():
    registry = CollectorRegistry()
    metrics = prom_metrics(registry)
    metrics.observe({"hit_tokens": 1, "tier_hit_tokens{tier=disk}": 2}, engine_idx=7)  # no such engine
    metrics.observe({"not_kvhals": 3, "tier_bogus{tier=disk}": 4}, engine_idx=0)
    # a family under the other kind's label is no kvhal statistic: no child made for it
    metrics.observe({"tier_hit_tokens{tenant=x}": 5, "tenant_hit_tokens{tier=disk}": 6}, engine_idx=0)
    assert sample(registry, "hit_tokens") == 0
    assert sample(registry, "tier_hit_tokens", tier="disk") is None
    assert sample(registry, "tier_hit_tokens", tier="x") is None
    assert sample(registry, "tenant_hit_tokens", tenant="disk") is None


def counter_tables() -> list[list[str]]:
    """The names in the first column of each table under docs/vllm-integration.md's "Counters"."""
    text = DOCS.read_text()
    section = text.split("\n### Counters\n", 1)[1].split("\n## ", 1)[0]
    tables: list[list[str]] = []
    in_table = False
    for line in section.splitlines():
        row = re.match(r"\| `([^`]+)` \|", line)
        if line.startswith("|") and not in_table:
            tables.append([])
        in_table = line.startswith("|")
        if row:
            tables[-1].append(row.group(1))
    return tables


def test_the_docs_counter_tables_are_the_codes():
    engine_wide, per_tier = counter_tables()
    assert len(engine_wide) == len(set(engine_wide)) and len(per_tier) == len(set(per_tier))
    assert set(engine_wide) == set(COUNTERS), "docs/vllm-integration.md's engine-wide table"
    assert set(per_tier) == set(TIER_COUNTERS), "docs/vllm-integration.md's per-tier table"
