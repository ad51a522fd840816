"""Connector statistics for vLLM's logger and Prometheus (``LLM.get_metrics()``): the counters' names and
how they add up (no vLLM import: the worker side counts where vLLM is not installed, in ``kvhal
replay``; :mod:`kvhal.vllm.prom_metrics` turns them into Prometheus families)."""

from __future__ import annotations

from dataclasses import dataclass

from kvhal import env
from kvhal.vllm.vllm_bases import KVConnectorStats

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
    "tier_previous_secret_blocks": "Blocks this store served signed with a previous secret (a rotation).",
    "tier_io_errors": "Blocks this tier could not read: its medium failed or the store was unreachable.",
    "tier_unreachable": "Times this store became unreachable.",
}
#: Per-tenant counter families -> help text, labelled ``tenant``: a request's ``cache_salt`` as
#: a short digest (:mod:`kvhal.vllm.tenants`; the first ``tenant_labels`` salts, then
#: ``"other"``). Requests without a salt count in the engine-wide counters only.
TENANT_COUNTERS = {
    "tenant_lookup_tokens": "Prompt tokens of this tenant's requests kvhal was asked about.",
    "tenant_hit_tokens": "Prompt tokens of this tenant's requests kvhal offered to load (any tier).",
    "tenant_stored_bytes": "Bytes this tenant's requests stored into kvhal's host tier (every worker's).",
}
#: A failed read's outcome (:class:`~kvhal.tiers.backend.ReadOutcome`) -> its family.
READ_FAILURE_COUNTERS = {
    "corrupt": "tier_corrupt_blocks",
    "foreign": "tier_foreign_blocks",
    "missing": "tier_missing_blocks",
    "unauthenticated": "tier_unauthenticated_blocks",
    "io_error": "tier_io_errors",
}


#: Histogram families (seconds, one observation per job or per request), labelled by tier.
#: The scheduler side times each from the job's start to the step that reports it, so a
#: time is an upper bound to one engine step.
HISTOGRAMS = {
    "lookup_wait_seconds": "Time a request waited at lookup: a store's answer, or its prefetch from it.",
    "tier_read_seconds": "Time a prefetch's read from this tier took, to the step that reported it.",
    "tier_write_seconds": "Time a write to this tier took (tier=host: a store from the KV cache).",
    "device_load_seconds": "Time a load into the KV cache took, by the tier it read from (host: a host hit).",
}
#: Bucket bounds (seconds) from 10 us to 10 s: a host hit's copy on a GPU to a slow store's read.
BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Engine-wide gauges: the scheduler side's host tier now.
GAUGES = {
    "host_used_slots": "Host tier slots holding a block (stored or being stored).",
    "host_pinned_slots": "Host tier slots a load in flight pins (not evictable).",
    "host_slots": "Host tier slots in all.",
}
#: Per-tier gauges, labelled by tier, set by the scheduler side (reported once, not summed).
TIER_GAUGES = {
    "tier_inflight_bytes": "Bytes being read from or written to this tier now (tier=host: KV cache copies).",
    "tier_used_bytes": "Bytes a local tier holds (its slots used x the slot size).",
    "tier_budget_bytes": "Bytes a local tier may hold (its slots x the slot size).",
    "tier_state": "This store's state now: 1 up, 0 down (unreachable), 2 refused (it answers, but "
    "kvhal refused every value it last read there: another secret, another KV's, corrupt).",
    "tier_up": "Whether this tier serves now (1) or not (0): a store reachable at its last call; "
    "a local tier 0 while another engine holds its medium (a rolling update), or past the wait.",
}
#: ``KVHAL_METRICS=counters`` records counters only (no histogram, no gauge): to compare.
RECORD_ALL = (env.read("KVHAL_METRICS") or "all") != "counters"


def tier_key(family: str, tier: str) -> str:
    """The name a tier's counter has in :class:`KVHALStats` and in vLLM's metrics as rendered
    by label (``tier_hit_tokens{tier=disk}``)."""
    return f"{family}{{tier={tier}}}"


def tenant_key(family: str, tenant: str) -> str:
    """A tenant's counter of ``family`` (``tenant_hit_tokens{tenant=1f2e3d4c}``)."""
    return f"{family}{{tenant={tenant}}}"


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
        if name not in _KINDS and not _known(name):  # a name asked before: no call (every event)
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

    def add_tenant(self, family: str, tenant: str, value: int) -> None:
        """Add ``value`` to tenant ``tenant``'s counter of ``family`` (:data:`TENANT_COUNTERS`)."""
        if family not in TENANT_COUNTERS:
            raise KeyError(family)
        if value:
            key = tenant_key(family, tenant)
            self.data[key] = self.data.get(key, 0) + value

    def observe(self, family: str, tier: str, seconds: float) -> None:
        """One observation of histogram ``family`` for ``tier`` (kept as a list: lists
        aggregate by concatenation, across workers and steps, and stay exact)."""
        if RECORD_ALL:
            key = tier_key(family, tier)
            values = self.data.get(key)
            if values is None:
                self.data[key] = [seconds]
            else:
                values.append(seconds)

    def set_gauge(self, key: str, value: int) -> None:
        """Gauge ``key`` (a name of :data:`GAUGES` or a :func:`tier_key` of
        :data:`TIER_GAUGES`) is ``value`` now: the last value wins, never a sum."""
        self.data[key] = value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVHALStats:
        for name, value in other.data.items():
            kind = kind_of(name)
            if kind == "histogram":
                self.data[name] = self.data.get(name, []) + list(value)
            elif kind == "gauge":  # the newer report's value (one reporter: the scheduler side)
                self.data[name] = value
            else:
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: a histogram as its count and mean (ms)."""
        reduced: dict[str, int | float] = {}
        for name, value in self.data.items():
            if isinstance(value, list):
                reduced[f"{name}_count"] = len(value)
                reduced[f"{name}_mean_ms"] = round(1e3 * sum(value) / len(value), 3) if value else 0.0
            else:
                reduced[name] = value
        return reduced

    def is_empty(self) -> bool:
        # a gauge back to 0 is news
        return not any(value or kind_of(name) == "gauge" for name, value in self.data.items())

    def take(self) -> KVHALStats | None:
        """This interval's stats (or None), leaving this object empty."""
        if self.is_empty():
            return None
        taken = KVHALStats(data=dict(self.data))
        self.reset()
        return taken


def split_label(key: str) -> tuple[str, str | None]:
    """``(family, label value)`` of a tier's or a tenant's key; ``(key, None)`` otherwise."""
    family, tier = split_key(key)
    if tier is None:
        base, brace, rest = key.partition("{tenant=")
        if brace and rest.endswith("}"):
            return base, rest[:-1]
    return family, tier


def _known(key: str) -> bool:
    return kind_of(key) is not None


#: :func:`kind_of`'s answers so far: a few dozen names, asked at every count (an engine's steps)
_KINDS: dict[str, str | None] = {}


def kind_of(key: str) -> str | None:
    """``"counter"``, ``"histogram"``, ``"gauge"`` or None (not a kvhal statistic)."""
    try:
        return _KINDS[key]
    except KeyError:
        pass
    kind = _kind_of(key)
    if kind is not None and len(_KINDS) < 10_000:  # known names only: a bounded set
        _KINDS[key] = kind
    return kind


def _kind_of(key: str) -> str | None:
    family, tier = split_key(key)
    if tier is None:
        if key in COUNTERS or key in GAUGES:  # the engine-wide names first: add() is per event
            return "counter" if key in COUNTERS else "gauge"
        family, tenant = split_label(key)
        return "counter" if tenant is not None and family in TENANT_COUNTERS else None
    if family in TIER_COUNTERS:
        return "counter"
    return "histogram" if family in HISTOGRAMS else "gauge" if family in TIER_GAUGES else None
