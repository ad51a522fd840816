"""kvhal's counters as vLLM's Prometheus metrics (``vllm:kvhal_*``), from :mod:`kvhal.vllm.stats`."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from kvhal.vllm.stats import (
    BUCKETS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    RECORD_ALL,
    TENANT_COUNTERS,
    TIER_COUNTERS,
    TIER_GAUGES,
    kind_of,
    split_label,
    tier_key,
)


class KVHALPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, named ``vllm:kvhal_<name>``, one
    per :data:`TIER_COUNTERS` family with a ``tier`` label besides vLLM's, a histogram per
    :data:`HISTOGRAMS` family and a gauge per :data:`GAUGES` and :data:`TIER_GAUGES` entry
    (a vLLM without a metric class of a kind: that kind is left out)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[str, int], Any] = {}  # (key, engine) -> a labelled child
        self._labelvalues = per_engine_labelvalues
        self._tiers: set[tuple[str, int]] = set()  # (tier, engine) whose counters exist
        tiered = [*labelnames, "tier"]
        gauge_cls = getattr(self, "_gauge_cls", None)
        histogram_cls = getattr(self, "_histogram_cls", None) if RECORD_ALL else None
        self._families: dict[str, Any] = {}  # name -> metric (children made per engine, tier)
        for name, help_text in COUNTERS.items():
            self._families[name] = self._counter_cls(
                name=f"vllm:kvhal_{name}", documentation=help_text, labelnames=labelnames
            )
        for family, help_text in TIER_COUNTERS.items():
            self._families[family] = self._counter_cls(
                name=f"vllm:kvhal_{family}", documentation=help_text, labelnames=tiered
            )
        for family, help_text in TENANT_COUNTERS.items():  # children only for tenants counted
            self._families[family] = self._counter_cls(
                name=f"vllm:kvhal_{family}", documentation=help_text, labelnames=[*labelnames, "tenant"]
            )
        if histogram_cls is not None:
            for family, help_text in HISTOGRAMS.items():
                self._families[family] = histogram_cls(
                    name=f"vllm:kvhal_{family}",
                    documentation=help_text,
                    labelnames=tiered,
                    buckets=list(BUCKETS),
                )
        if gauge_cls is not None and RECORD_ALL:
            for name, help_text in [*GAUGES.items(), *TIER_GAUGES.items()]:
                self._families[name] = gauge_cls(
                    name=f"vllm:kvhal_{name}",
                    documentation=help_text,
                    labelnames=tiered if name in TIER_GAUGES else labelnames,
                    multiprocess_mode="mostrecent",
                )
        for name in COUNTERS:  # engine-wide counters show 0 before their first count
            for engine, values in per_engine_labelvalues.items():
                self._counters[(name, engine)] = self._families[name].labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            kind = kind_of(key)
            if kind is None or (not value and kind != "gauge"):  # not kvhal's, or nothing counted
                continue
            metric = self._counters.get((key, engine_idx))
            if metric is None:
                metric = self._child(key, engine_idx)
                if metric is None:
                    continue
            if kind == "histogram":
                for seconds in value:
                    metric.observe(seconds)
            elif kind == "gauge":
                metric.set(value)
            else:
                metric.inc(value)

    def _child(self, key: str, engine_idx: int) -> Any:
        """A key's child of its family, made the first time it reports."""
        family, tier = split_label(key)  # tier: a tier's name, or a tenant's label
        values = self._labelvalues.get(engine_idx)
        metric = self._families.get(family)
        if metric is None or values is None:
            return None
        if tier is not None and family in TIER_COUNTERS and (tier, engine_idx) not in self._tiers:
            # a tier's first count: each of its counters from 0, so a failure's rate() is 0,
            # not absent (not on a histogram's or gauge's report: tier="host" counts nothing)
            self._tiers.add((tier, engine_idx))
            for name in TIER_COUNTERS:
                self._counters[(tier_key(name, tier), engine_idx)] = self._families[name].labels(
                    *values, tier
                )
        child = self._counters.get((key, engine_idx))
        if child is None:
            child = metric.labels(*values) if tier is None else metric.labels(*values, tier)
            self._counters[(key, engine_idx)] = child
        return child
