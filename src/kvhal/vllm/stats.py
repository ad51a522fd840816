"""Connector statistics for vLLM's logger and Prometheus (``LLM.get_metrics()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

#: Counter name -> help text. Scheduler side: lookups and hits; worker side: bytes moved.
COUNTERS = {
    "lookup_tokens": "Prompt tokens kvhal was asked about (beyond the local prefix cache).",
    "hit_tokens": "Prompt tokens kvhal offered to load (from its host tier or a tier below it).",
    "sync_hit_tokens": "Prompt tokens loaded in the step that scheduled them (host hits, no parked step).",
    "layerwise_loads": "Synchronous loads copied layer by layer (each layer's attention waited for its own).",
    "loaded_blocks": "Blocks copied from kvhal's host tier into the KV cache.",
    "loaded_bytes": "Bytes copied from kvhal's host tier into the KV cache.",
    "stored_blocks": "Blocks copied from the KV cache into kvhal's host tier.",
    "stored_bytes": "Bytes copied from the KV cache into kvhal's host tier.",
    "failed_loads": "Load jobs that failed (their tokens were recomputed).",
    "failed_stores": "Store jobs that failed (their blocks never became loadable).",
    "evicted_blocks": "Blocks evicted from kvhal's host tier.",
    "store_skipped_blocks": "Blocks not stored because the host tier had no evictable room.",
    "worker_busy_us": "Microseconds engine steps spent in kvhal's worker side (fences, submits, waits).",
    "fenced_stores": "Store jobs a step's compute waited for: their blocks were preempted or reallocated.",
    "held_requests": "Finished requests whose blocks vLLM kept until their stores to the host tier ended.",
}
#: Per-tier counter families -> help text: one Prometheus counter each, labelled with the
#: tier's name (``vllm:kvhal_tier_hit_tokens{tier="disk"}``), for every tier below the host
#: tier (a local one, as the disk tier, or a store the fleet shares).
TIER_COUNTERS = {
    "tier_hit_tokens": "Prompt tokens kvhal offered to load that were read from this tier first.",
    "tier_recovered_blocks": "Blocks a starting engine found in this tier (a warm restart).",
    "tier_lookups": "Requests whose blocks beyond the tiers above were looked up in this store.",
    "tier_lookup_timeouts": "Lookups in this store that did not answer in time (a miss).",
    "tier_lookup_errors": "Lookups in this store that failed: it was unreachable (a miss).",
    "tier_prefetched_blocks": "Blocks read from this tier into host memory at lookup, for a waiting request.",
    "tier_prefetch_timeouts": "Requests that stopped waiting for a prefetch from this tier (its deadline).",
    "tier_prefetch_skipped_blocks": "Blocks not prefetched (budget or host room): loaded asynchronously.",
    "tier_probes": "Reads from this tier made to measure it while their request recomputed.",
    "tier_slow_blocks": "Blocks recomputed, not read: this tier reads slower than the engine computes.",
    "tier_loaded_blocks": "Blocks read from this tier into the host tier for a load.",
    "tier_load_timeouts": "Loads that gave up waiting for this tier (its wait, then recomputed).",
    "tier_failed_loads": "Load jobs whose reads from this tier failed (their tokens were recomputed).",
    "tier_read_bytes": "Bytes read from this tier (a store's value headers excluded).",
    "tier_written_blocks": "Blocks written from the host tier to this tier.",
    "tier_written_bytes": "Bytes written to this tier (a store's value headers excluded).",
    "tier_failed_writes": "Write jobs to this tier that failed (their blocks are not loadable there).",
    "tier_write_skipped_blocks": "Blocks not written to this tier because it had no evictable room.",
    "tier_slow_skipped_writes": "Blocks not written to this tier while it read slower than recomputing.",
    "tier_dropped_blocks": "Blocks not written to this store: too many in flight, or the store down.",
    "tier_evicted_blocks": "Blocks evicted from this tier.",
    "tier_corrupt_blocks": "Blocks this tier refused: checksum mismatch, a torn write, a malformed value.",
    "tier_foreign_blocks": "Blocks this tier refused: stored for other KV (fingerprint or name mismatch).",
    "tier_missing_blocks": "Blocks this tier did not hold where expected (evicted, another key, none).",
    "tier_unauthenticated_blocks": "Blocks this store refused: no valid HMAC of KVHAL_REMOTE_SECRET.",
    "tier_io_errors": "Blocks this tier could not read: its medium failed or the store was unreachable.",
    "tier_unreachable": "Times this store became unreachable.",
}
#: A failed read's outcome (:class:`~kvhal.tiers.backend.ReadOutcome`) -> its family.
READ_FAILURE_COUNTERS = {
    "corrupt": "tier_corrupt_blocks",
    "foreign": "tier_foreign_blocks",
    "missing": "tier_missing_blocks",
    "unauthenticated": "tier_unauthenticated_blocks",
    "io_error": "tier_io_errors",
}


def tier_key(family: str, tier: str) -> str:
    """The name a tier's counter has in :class:`KVHALStats` and in vLLM's metrics as rendered
    by label (``tier_hit_tokens{tier=disk}``)."""
    return f"{family}{{tier={tier}}}"


def split_key(key: str) -> tuple[str, str | None]:
    """``(family, tier)`` of a :func:`tier_key` (``(name, None)`` for an engine-wide counter)."""
    family, brace, rest = key.partition("{tier=")
    return (family, rest[:-1]) if brace and rest.endswith("}") else (key, None)


@dataclass
class KVHALStats(KVConnectorStats):
    """Counters summed across workers and steps: engine-wide ones by name, per-tier ones by
    :func:`tier_key` (vLLM hands ``data`` from the workers to the scheduler as it is)."""

    def __post_init__(self) -> None:
        unknown = [key for key in self.data if not _known(key)]
        if unknown:
            raise ValueError(f"unknown kvhal counters {sorted(unknown)}")

    def add(self, name: str, value: int) -> None:
        """Add ``value`` to the engine-wide counter ``name`` (or to a :func:`tier_key`)."""
        if not _known(name):
            raise KeyError(name)
        if value:
            self.data[name] = self.data.get(name, 0) + value

    def add_tier(self, family: str, tier: str, value: int) -> None:
        """Add ``value`` to tier ``tier``'s counter of ``family``."""
        if family not in TIER_COUNTERS:
            raise KeyError(family)
        if value:
            key = tier_key(family, tier)
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVHALStats:
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KVHALStats | None:
        """This interval's stats (or None), leaving this object empty."""
        if self.is_empty():
            return None
        taken = KVHALStats(data=dict(self.data))
        self.reset()
        return taken


def _known(key: str) -> bool:
    family, tier = split_key(key)
    return family in TIER_COUNTERS if tier is not None else key in COUNTERS


class KVHALPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, named ``vllm:kvhal_<name>``, and one
    per :data:`TIER_COUNTERS` family with a ``tier`` label besides vLLM's."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[str, int], Any] = {}
        for name, help_text in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:kvhal_{name}", documentation=help_text, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[(name, engine)] = counter.labels(*values)
        self._labelvalues = per_engine_labelvalues
        self._families = {
            family: self._counter_cls(
                name=f"vllm:kvhal_{family}", documentation=help_text, labelnames=[*labelnames, "tier"]
            )
            for family, help_text in TIER_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if not value:
                continue
            counter = self._counters.get((name, engine_idx))
            if counter is None:
                counter = self._tier_counter(name, engine_idx)
            if counter is not None:
                counter.inc(value)

    def _tier_counter(self, key: str, engine_idx: int) -> Any:
        """A tier's child of its family's counter, made the first time the tier counts."""
        family, tier = split_key(key)
        values = self._labelvalues.get(engine_idx)
        if tier is None or family not in self._families or values is None:
            return None
        counter = self._counters[(key, engine_idx)] = self._families[family].labels(*values, tier)
        return counter
