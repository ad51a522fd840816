"""The worker-side half of KVHALConnector: the device plugin, the host tier, the copies.

On ``register_kv_caches`` it picks the kvhal device plugin for the device the
engine's KV cache lives on (or the one the user named), wraps each offloaded
KV cache group's layer tensors as a :class:`~kvhal.cache.KVCache` and lays
the same group geometry over one pinned host buffer. Loads run at the start
of a step and are waited for within it (a parked request resumes next step);
stores are submitted after the forward, ordered after compute by the device
facade, and fenced: before the next step's compute the compute stream waits
for them, so a freed block is never rewritten while it is being read.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from vllm.logger import init_logger

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.host_tier import HostTier
from kvhal.layouts import layout_by_name
from kvhal.registry import select_device
from kvhal.transfer import TransferEngine, TransferResult
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.metadata import JobKind, KVHALMetadata, KVHALWorkerMetadata, TransferJob
from kvhal.vllm.stats import KVHALStats

logger = init_logger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _on_engine_thread(method: F) -> F:
    """Count the time a step spends in kvhal: what it can add to the engine's critical path."""

    @functools.wraps(method)
    def timed(self: WorkerSide, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            self.stats.add("worker_busy_us", int(elapsed * 1e6))

    return timed  # type: ignore[return-value]


@dataclass
class _Running:
    job: TransferJob
    engine_jobs: set[int]
    ok: bool = True


@dataclass
class WorkerSide:
    """Worker-side state of one engine's connector."""

    config: ConnectorConfig
    stats: KVHALStats = field(default_factory=KVHALStats)

    def __post_init__(self) -> None:
        self.device: Device | None = None
        self.host_tier: HostTier | None = None
        self.engine: TransferEngine | None = None
        self.caches: dict[int, KVCache] = {}
        self.host_views: dict[int, KVCache] = {}
        self._running: dict[int, _Running] = {}
        self._by_engine_job: dict[int, int] = {}
        self._succeeded: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._loads_this_step: set[int] = set()
        self.busy_seconds = 0.0

    # -- set-up ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self.device = select_device(self.config.device, device_type=first.device.type)
        layout = layout_by_name(self.config.layout)
        for group in self.config.groups:
            views = [kv_caches[name] for name in group.layer_names]
            self.caches[group.group_id] = KVCache.wrap(views, layout, head_size=group.head_size)
        self.host_tier = HostTier(
            self.device, self.config.num_slots * self.config.slot_bytes, self.config.slot_bytes
        )
        for group_id, cache in self.caches.items():
            self.host_views[group_id] = self.host_tier.view(cache.geometry, layout)
        self.engine = TransferEngine(self.device)
        logger.info(
            "kvhal: device plugin %r (%s), %d host slots of %d bytes, pinned=%s",
            self.device.plugin_name,
            self.device.distribution,
            self.config.num_slots,
            self.config.slot_bytes,
            self.host_tier.is_pinned,
        )

    # -- per step -----------------------------------------------------------------

    @_on_engine_thread
    def fence_stores(self) -> None:
        """Order the coming step's compute after every store still reading KV blocks."""
        if self.engine is not None:
            self.engine.fence(self.device.current_stream())

    @_on_engine_thread
    def start_loads(self, meta: KVHALMetadata) -> None:
        for job in meta.loads:
            self._loads_this_step.add(job.job_id)
            self._submit(job)

    @_on_engine_thread
    def start_stores(self, meta: KVHALMetadata) -> None:
        for job in meta.stores:
            self._submit(job)

    def _submit(self, job: TransferJob) -> None:
        assert self.engine is not None
        running = self._running[job.job_id] = _Running(job, set())
        for group_id, (block_ids, slots) in job.groups.items():
            if not block_ids:
                continue
            cache, host = self.caches[group_id], self.host_views[group_id]
            keys = ()  # the manager's keys stay scheduler-side; jobs are tracked by id
            try:
                if job.kind is JobKind.STORE:
                    engine_job = self.engine.submit_store(
                        keys, cache, host, list(zip(block_ids, slots, strict=True))
                    )
                else:
                    engine_job = self.engine.submit_load(
                        keys, host, cache, list(zip(slots, block_ids, strict=True))
                    )
            except Exception:  # a refused copy fails the job; the engine recomputes or skips it
                logger.exception("kvhal: %s job %d refused", job.kind.value, job.job_id)
                running.ok = False
                continue
            running.engine_jobs.add(engine_job)
            self._by_engine_job[engine_job] = job.job_id
        if not running.engine_jobs:
            self._finish(job.job_id)

    def _on_result(self, result: TransferResult) -> None:
        job_id = self._by_engine_job.pop(result.job_id)
        running = self._running[job_id]
        running.engine_jobs.discard(result.job_id)
        running.ok &= result.success
        if not result.success:
            logger.warning("kvhal: %s job %d failed: %s", running.job.kind.value, job_id, result.error)
        if not running.engine_jobs:
            self._finish(job_id)

    def _finish(self, job_id: int) -> None:
        running = self._running.pop(job_id)
        job = running.job
        outcome = self._succeeded if running.ok else self._failed
        outcome[job_id] = outcome.get(job_id, 0) + 1
        nbytes = job.num_blocks * self.config.slot_bytes  # one slot per (group, block)
        if job.kind is JobKind.LOAD:
            self._finished_loads.add(job.req_id)
            if not running.ok:
                self._failed_loads.add(job.req_id)
            elif job.num_blocks:
                self.stats.add("loaded_blocks", job.num_blocks)
                self.stats.add("loaded_bytes", nbytes)
        elif running.ok:
            self.stats.add("stored_blocks", job.num_blocks)
            self.stats.add("stored_bytes", nbytes)

    @_on_engine_thread
    def collect(self) -> tuple[set[str], set[str]]:
        """Finished and failed loads (request ids), waiting for this step's loads first."""
        assert self.engine is not None or not self._running
        if self.engine is not None:
            this_step = [
                e
                for job_id in self._loads_this_step
                if job_id in self._running
                for e in self._running[job_id].engine_jobs
            ]
            for result in self.engine.wait(this_step) if this_step else ():
                self._on_result(result)
            for result in self.engine.poll():
                self._on_result(result)
        self._loads_this_step.clear()
        finished, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return finished, failed

    @property
    def jobs_in_flight(self) -> int:
        return len(self._running)

    def worker_meta(self) -> KVHALWorkerMetadata | None:
        if not self._succeeded and not self._failed:
            return None
        meta = KVHALWorkerMetadata(succeeded=self._succeeded, failed=self._failed)
        self._succeeded, self._failed = {}, {}
        return meta

    def shutdown(self) -> None:
        if self.engine is not None:
            for result in self.engine.wait():
                self._on_result(result)
        if self.host_tier is not None:
            self.host_views.clear()
            self.host_tier.close()
            self.host_tier = None
