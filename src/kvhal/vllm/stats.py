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
    "hit_tokens": "Prompt tokens kvhal offered to load from its host tier.",
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
    # the tier below host memory (disk, or a plugin's backend)
    "tier_recovered_blocks": "Blocks a starting engine found in the lower tier (a warm restart).",
    "tier_hit_tokens": "Prompt tokens kvhal offered to load that were read from the lower tier first.",
    "prefetched_blocks": "Blocks read from the lower tier into host memory at lookup, for a waiting request.",
    "prefetch_timeouts": "Requests that stopped waiting for a prefetch (past its deadline).",
    "prefetch_skipped_blocks": "Blocks not prefetched (budget or host room): loaded asynchronously instead.",
    "prefetch_probes": "Reads from the lower tier made to measure it while their request recomputed.",
    "prefetch_slow_tier_blocks": "Blocks recomputed, not read: the lower tier is slower than the engine.",
    "tier_loaded_blocks": "Blocks read from the lower tier into the host tier for a load.",
    "tier_slow_skipped_writes": "Blocks not written to the lower tier while it read slower than recomputing.",
    "tier_load_timeouts": "Loads that gave up waiting for the lower tier (lower_tier_wait_ms, else 1 s).",
    "tier_failed_loads": "Load jobs whose reads from the lower tier failed (their tokens were recomputed).",
    "tier_written_blocks": "Blocks written from the host tier to the lower tier.",
    "tier_failed_writes": "Write jobs to the lower tier that failed (their blocks are not loadable there).",
    "tier_write_skipped_blocks": "Blocks not written to the lower tier because it had no evictable room.",
    "tier_evicted_blocks": "Blocks evicted from the lower tier.",
    "tier_read_bytes": "Bytes read from the lower tier.",
    "tier_written_bytes": "Bytes written to the lower tier.",
    "tier_corrupt_blocks": "Blocks the lower tier refused: checksum mismatch (a torn write, flipped bits).",
    "tier_foreign_blocks": "Blocks the lower tier refused: stored for other KV (fingerprint mismatch).",
    "tier_missing_blocks": "Blocks the lower tier did not hold where its index said (another key, or none).",
    "tier_io_errors": "Blocks the lower tier could not read because its medium failed.",
    # the remote tier shared by a fleet (remote_url)
    "remote_lookups": "Requests whose blocks beyond the local tiers were looked up in the remote tier.",
    "remote_lookup_timeouts": "Remote lookups that did not answer in remote_lookup_timeout_ms (a miss).",
    "remote_lookup_errors": "Remote lookups that failed because the store was unreachable (a miss).",
    "remote_hit_tokens": "Prompt tokens kvhal offered to load that were read from the remote tier first.",
    "remote_prefetched_blocks": "Blocks read from the remote tier into host memory at lookup, for a request.",
    "remote_prefetch_timeouts": "Requests that stopped waiting for a prefetch from the store (its deadline).",
    "remote_prefetch_skipped_blocks": "Blocks not prefetched from the store (budget, room): loaded later.",
    "remote_probes": "Reads from the remote tier made to measure it while their request recomputed.",
    "remote_slow_blocks": "Blocks recomputed, not read: the remote tier is slower than the engine.",
    "remote_loaded_blocks": "Blocks read from the remote tier into the host tier for a load.",
    "remote_failed_loads": "Load jobs whose reads from the remote tier failed or timed out (recomputed).",
    "remote_load_timeouts": "Load jobs that gave up waiting for the remote tier (remote_load_timeout_ms).",
    "remote_written_blocks": "Blocks written from the host tier to the remote tier.",
    "remote_failed_writes": "Write jobs to the remote tier that failed (store full, unreachable).",
    "remote_dropped_blocks": "Blocks not written to the remote tier: too many in flight, or the store down.",
    "remote_read_bytes": "Bytes read from the remote tier (headers excluded).",
    "remote_written_bytes": "Bytes written to the remote tier (headers excluded).",
    "remote_corrupt_blocks": "Blocks the remote tier refused: checksum mismatch or a malformed value.",
    "remote_foreign_blocks": "Blocks the remote tier refused: stored for other KV or under another name.",
    "remote_missing_blocks": "Blocks the remote tier no longer held when read (evicted since the lookup).",
    "remote_unauthenticated_blocks": "Blocks the remote tier refused: no valid HMAC of KVHAL_REMOTE_SECRET.",
    "remote_io_errors": "Blocks the remote tier could not read because the store was unreachable.",
    "remote_unreachable": "Times the remote tier's store became unreachable.",
}

#: A read outcome of a tier backend -> the counter that counts it.
TIER_READ_COUNTERS = {
    "corrupt": "tier_corrupt_blocks",
    "foreign": "tier_foreign_blocks",
    "missing": "tier_missing_blocks",
    "io_error": "tier_io_errors",
}
#: A read outcome of the remote tier -> the counter that counts it.
REMOTE_READ_COUNTERS = {
    "corrupt": "remote_corrupt_blocks",
    "foreign": "remote_foreign_blocks",
    "missing": "remote_missing_blocks",
    "unauthenticated": "remote_unauthenticated_blocks",
    "io_error": "remote_io_errors",
}


@dataclass
class KVHALStats(KVConnectorStats):
    """Flat counters, summed across workers and steps."""

    def __post_init__(self) -> None:
        unknown = set(self.data) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown kvhal counters {sorted(unknown)}")

    def add(self, name: str, value: int) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        if value:
            self.data[name] = self.data.get(name, 0) + value

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


class KVHALPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, named ``vllm:kvhal_<name>``."""

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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((name, engine_idx))
            if counter is not None and value:
                counter.inc(value)
