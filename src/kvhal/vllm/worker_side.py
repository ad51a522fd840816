"""The worker-side half of KVHALConnector: the device plugin, the host tier, the copies.

On ``register_kv_caches`` it picks the kvhal device plugin for the device the
engine's KV cache lives on (or the one the user named), wraps each offloaded
KV cache group's layer tensors (one tensor per layer, a (K, V) pair as
vllm-ascend passes, or another shape :mod:`kvhal.vllm.cache_shapes` takes) as a
:class:`~kvhal.cache.KVCache` and lays the same group geometry over one pinned host buffer.

Nothing here waits for a copy on the engine's thread except a fence the
scheduler asked for and a synchronous load: a host hit vLLM scheduled in this
step is submitted before the forward, and the compute stream waits for it (on
a device with streams the thread does not; on the CPU it waits for the copy).
A failed one is reported as invalid blocks, which vLLM recomputes; a large one may
be copied layer by layer (:mod:`kvhal.vllm.layer_gate`).
Asynchronous loads are polled: a request parked for its load is reported in
the step its load is found done. Stores are submitted after the forward, ordered after its compute
by the device facade, and overlap the following steps; the compute stream
waits only for the stores the step's metadata names (their blocks may be
rewritten), and a finished request the scheduler held is reported in
``finished_sending`` once this worker's stores of it finished. What it has yet to
report, to vLLM and to the scheduler side, is kept in a
:class:`~kvhal.vllm.worker_reports.WorkerReports`.

With a tier below host memory, this worker reads and writes its own share of
each block there (:class:`~kvhal.tiers.io.TierIO`, on the backend's threads): a
load that promotes blocks first reads them into host slots, polled like any
copy, then loads them as host hits; a failed read fails the load (vLLM
recomputes). Write jobs are submitted before the step's other copies.

With a remote tier, loads read their remote blocks the same way (on the
remote tier's threads); one that waits longer than ``remote_load_timeout_ms``
is reported failed to vLLM at once (the request is recomputed), while its
host slots stay reserved until the read really ends, so a late reply never
lands in a reused slot.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.logger import init_logger

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.errors import ValidationError
from kvhal.layouts import layout_by_name
from kvhal.offload.host_tier import HostTier
from kvhal.offload.transfer import TransferEngine, TransferResult
from kvhal.registry import select_device
from kvhal.tiers.backend import OK, ReadOutcome, TierBackend
from kvhal.tiers.io import TierIO
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm import local
from kvhal.vllm.cache_shapes import group_views
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.layer_gate import LayerGate
from kvhal.vllm.lower_tier import lower_tier_name, open_lower_tier
from kvhal.vllm.metadata import (
    JobKind,
    KVHALMetadata,
    KVHALWorkerMetadata,
    TierReads,
    TierWrite,
    TransferJob,
)
from kvhal.vllm.remote import open_remote_tier, remote_tier_name
from kvhal.vllm.stats import READ_FAILURE_COUNTERS, KVHALStats
from kvhal.vllm.versions import STATS_NEED_REQUEST_OUTPUTS
from kvhal.vllm.worker_reports import WorkerReports

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level
F = TypeVar("F", bound=Callable[..., Any])

#: How long an idle step's :meth:`WorkerSide.collect` waits for a job in flight to end, and
#: how often it looks: vLLM steps an engine with no request about every millisecond while
#: kvhal has jobs in flight (writes to the tiers below outlive their requests), and a new
#: request arriving meanwhile waits at most this.
IDLE_WAIT_S = 0.02
IDLE_POLL_S = 0.002
#: How long shutdown waits for the reads and writes of the tiers below still in flight.
#: Past it, their host memory and their tiers are left as they are (not freed, not closed: a
#: late read must not land in freed memory), and the engine's shutdown goes on.
SHUTDOWN_WAIT_S = 10.0
#: How long an asynchronous load waits for its reads from the lower tier when
#: ``lower_tier_wait_ms`` is null (no prefetch); past it, the request is recomputed and the
#: slots stay reserved until the read returns.
LOWER_LOAD_WAIT_MS = 1000


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
class _Reading:
    """A load's reads from the tiers below into host slots, before its copy to the device."""

    job: TransferJob
    reads: list[tuple[TierReads, bool, Future[list[ReadOutcome]]]]  # (reads, remote?, future)
    deadline: float | None = None  # when the load is given up (its request recomputed)
    gave_up: bool = False  # reported failed to vLLM; the job ends once the reads end


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
        self.reports = WorkerReports()  # what this worker has yet to report
        self._stores_started: KVHALMetadata | None = None  # the step whose stores were submitted
        self._sync_jobs: set[int] = set()  # synchronous loads not yet reported
        self._idle = False  # this step computes nothing and no request waits (KVHALMetadata.idle)
        self.layer_gate = LayerGate(self.config)  # large synchronous loads, layer by layer
        self.busy_seconds = 0.0
        self.lower_backend: TierBackend | None = None
        self.tier_io: TierIO | None = None
        self.remote: RemoteTier | None = None
        self._reads: dict[int, _Reading] = {}
        self._writes: dict[int, tuple[TierWrite, Future[list[bool]]]] = {}

    # -- set-up ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Wrap the engine's KV cache and allocate the host tier.

        :param kv_caches: per layer name, a logical ``[B, H, N, C]`` tensor, a
            ``(k_cache, v_cache)`` pair of them (split K and V, as vllm-ascend has; of other
            sizes or dtypes too), or a 1-tuple ``(k_cache,)``; :mod:`kvhal.vllm.cache_shapes`
            says which shapes are offloaded and which refused.
        :raises ValidationError: a layer is missing or of a shape kvhal refuses, or its blocks
            do not hold the bytes vLLM's KV cache spec says (naming the layer).
        """
        views = group_views(kv_caches, self.config.groups)
        first = next(iter(views.values())).layers[0][0]
        self.device = select_device(self.config.device, device_type=first.device.type)
        layout = layout_by_name(self.config.layout)
        for group in self.config.groups:
            tensors = views[group.group_id]
            cache = KVCache.wrap(tensors.layers, layout, head_size=tensors.head_size)
            if cache.geometry.block_bytes != group.slot_bytes:
                raise ValidationError(
                    "kv_caches",
                    f"KV cache group {group.group_id} (layers {group.layer_names[0]!r}...): a block of "
                    f"its tensors holds {cache.geometry.block_bytes} bytes, vLLM's KV cache spec says "
                    f"{group.slot_bytes} ({len(group.layer_names)} layers x {group.page_bytes})",
                )
            self.caches[group.group_id] = cache
        self.host_tier = HostTier(
            self.device, self.config.num_slots * self.config.slot_bytes, self.config.slot_bytes
        )
        for group_id, cache in self.caches.items():
            host = self.host_views[group_id] = self.host_tier.view(cache.geometry, layout)
            # a copy the device cannot make (a split cache on a plugin without kv.split,
            # say) fails engine start, naming the plugin, rather than every job later
            self.device.plan_copy(cache, host, [(0, 0)])
        for group in self.config.groups:
            self.layer_gate.add_group(group, self.caches[group.group_id], self.host_views[group.group_id])
        self.engine = TransferEngine(self.device)
        if self.config.lower_tier is not None:
            self.lower_backend = open_lower_tier(self.config, role="io", rank=_tensor_parallel_rank())
            self.tier_io = TierIO(self.host_tier, self.lower_backend)
        if self.config.remote_tier is not None:
            rank = _tensor_parallel_rank()
            self.remote = open_remote_tier(self.config, "io", rank, self.stats, host=self.host_tier)
        below = self.tier_io is not None or self.remote is not None
        if below and self.config.world_size == 1 and self.config.engine_id is not None:
            local.publish(self.config.engine_id, self)  # the scheduler reads at lookup
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
    def begin_step(self, meta: KVHALMetadata) -> None:
        """Before the step's compute: fence the stores whose blocks it may rewrite,
        and take note of the finished requests the scheduler holds for their stores."""
        if self.engine is not None and meta.fence:
            running = [self._running[j] for j in meta.fence if j in self._running]  # others are done
            engine_jobs = [e for job in running for e in job.engine_jobs]
            self.engine.fence(self.device.current_stream(), engine_jobs)
        for write in meta.writes:  # first: a write-back snapshots slots this step reuses
            self._start_write(write)
        for job in meta.prefetches:  # before the forward: the reads overlap it
            self._start_reads(job)
        self._idle = meta.idle
        for req_id in meta.held:
            self.reports.hold(req_id)

    @_on_engine_thread
    def start_loads(self, meta: KVHALMetadata) -> None:
        """Submit this step's loads (host tier -> KV cache), reading promoted blocks from
        the lower tier first; :meth:`collect` reports them. The compute stream waits for
        the synchronous ones: vLLM runs their requests in this step's forward."""
        sync_copies: list[int] = []
        by_layer: list[TransferJob] = []
        for job in meta.loads:
            if job.sync:
                self._sync_jobs.add(job.job_id)
            if job.doomed:
                self._running[job.job_id] = _Running(job, set(), ok=False)
                self._finish(job.job_id)
            elif job.reads is not None or job.remote_reads is not None:
                self._start_reads(job)
            elif job.sync and self.layer_gate.takes(job, self.device):
                by_layer.append(job)
            else:
                self._submit(job)
                running = self._running.get(job.job_id)
                if job.sync and running is not None:
                    sync_copies.extend(running.engine_jobs)
        if by_layer:
            self._submit_by_layer(by_layer)
        if sync_copies:
            assert self.engine is not None and self.device is not None
            self.engine.order_after(self.device.current_stream(), sync_copies)

    def _submit_by_layer(self, jobs: list[TransferJob]) -> None:
        """Submit synchronous loads layer by layer (:class:`~kvhal.vllm.layer_gate.LayerGate`):
        the attention of each layer waits for its copies only, in :meth:`wait_for_layer`."""
        assert self.engine is not None
        self.stats.add("layerwise_loads", len(jobs))
        copies, refused = self.layer_gate.submit(self.engine, jobs)
        for job in jobs:
            engine_jobs = copies[job.job_id]
            self._running[job.job_id] = _Running(job, engine_jobs, ok=job.job_id not in refused)
            self._by_engine_job.update(dict.fromkeys(engine_jobs, job.job_id))
            if not engine_jobs:
                self._finish(job.job_id)

    @_on_engine_thread
    def wait_for_layer(self, name: str) -> None:
        """vLLM's attention of layer ``name`` is about to run: its copies come first."""
        copies = self.layer_gate.wait_for(name)
        if copies:
            assert self.engine is not None and self.device is not None
            self.engine.order_after(self.device.current_stream(), copies)

    def _end_forward(self) -> None:
        """After the forward: a copy no layer waited for is waited for now, its job failed."""
        left = self.layer_gate.end_forward()
        if left:
            for copy in left:
                running = self._running.get(self._by_engine_job.get(copy, -1))
                if running is not None:
                    running.ok = False
            assert self.engine is not None and self.device is not None
            self.engine.order_after(self.device.current_stream(), left)

    def _start_reads(self, job: TransferJob) -> None:
        reading = _Reading(job, [])
        try:
            if job.reads is not None:
                assert self.tier_io is not None and self.config.lower_tier is not None
                reads = job.reads
                future = self.tier_io.read(reads.keys, reads.lower_slots, reads.host_slots)
                reading.reads.append((reads, False, future))
                if not job.prefetch:  # a prefetch's deadline is the scheduler side's
                    wait_ms = self.config.lower_tier.wait_ms
                    reading.deadline = (
                        time.monotonic() + (wait_ms if wait_ms is not None else LOWER_LOAD_WAIT_MS) / 1000
                    )
            if job.remote_reads is not None:
                assert self.remote is not None and self.config.remote_tier is not None
                reads = job.remote_reads
                reading.reads.append((reads, True, self.remote.read(reads.keys, reads.host_slots)))
                deadline = time.monotonic() + self.config.remote_tier.load_timeout_ms / 1000
                reading.deadline = min(deadline, reading.deadline or deadline)
        except Exception:  # a refused read fails the load; vLLM recomputes
            logger.exception("kvhal: load job %d: reading a tier below was refused", job.job_id)
            if not reading.reads:
                self._running[job.job_id] = _Running(job, set(), ok=False)
                self._finish(job.job_id)
                return
            reading.gave_up = True  # the read started must end before its slots are released
            self.reports.give_up(job)
        self._reads[job.job_id] = reading

    @_on_engine_thread
    def start_stores(self, meta: KVHALMetadata) -> None:
        """Submit this step's stores (KV cache -> host tier), ordered after the step's compute;
        once per step (a step without a forward submits them with its loads)."""
        if meta is self._stores_started:
            return
        self._stores_started = meta
        self._end_forward()
        for job in meta.stores:
            self._submit(job)

    def _submit(self, job: TransferJob) -> None:
        assert self.engine is not None
        running = self._running[job.job_id] = _Running(job, set())
        if job.kind is JobKind.STORE:
            self.reports.store_started(job)
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
        self.reports.ended(job_id, running.ok)
        # Bytes are counted where they move: each tensor-parallel worker copies its own
        # share, and vLLM sums the workers' stats. Blocks are counted once, scheduler-side.
        nbytes = job.num_blocks * self.config.slot_bytes  # one slot per (group, block)
        if job.kind is JobKind.LOAD and job.prefetch:
            pass  # no device copy, no request waiting in vLLM: the scheduler side hears of it
        elif job.kind is JobKind.LOAD:
            sync = job.job_id in self._sync_jobs
            self._sync_jobs.discard(job.job_id)
            self.reports.load_ended(job, running.ok, sync)
            if running.ok and job.num_blocks:
                self.stats.add("loaded_bytes", nbytes)
        else:
            if running.ok:
                self.stats.add("stored_bytes", nbytes)
            if job.write is not None:
                self._start_write(job.write, stored=running.ok)
            if job.remote_write is not None:
                self._start_write(job.remote_write, stored=running.ok)
            self.reports.store_ended(job)

    @_on_engine_thread
    def collect(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose loads finished, whose loads failed (a subset), and whose
        held blocks the stores read no more; polls, never waits for a copy (but in an idle
        step, up to :data:`IDLE_WAIT_S` for one of its jobs to end)."""
        assert self.engine is not None or not self._running
        self._poll()
        if self._idle and self.jobs_in_flight:
            deadline = time.monotonic() + IDLE_WAIT_S
            while not self.reports.has_news() and self.jobs_in_flight and time.monotonic() < deadline:
                time.sleep(IDLE_POLL_S)
                self._poll()
        return self.reports.take_requests()

    def _poll(self) -> None:
        self._poll_tier()
        if self.engine is not None:
            # A synchronous load is reported in its own step: the forward waited for its
            # copy, so this wait is for an event already complete (or failed).
            pending = [e for j in self._sync_jobs if j in self._running for e in self._running[j].engine_jobs]
            for result in self.engine.wait(pending) if pending else ():
                self._on_result(result)
            for result in self.engine.poll():
                self._on_result(result)

    def _start_write(self, write: TierWrite, stored: bool = True) -> None:
        """Submit a write to the lower tier; a write-through whose store failed fails unrun."""
        if not stored:
            self.reports.ended(write.job_id, ok=False)
            return
        try:
            if write.remote:
                assert self.remote is not None
                future = self.remote.write(write.keys, write.host_slots)
            else:
                assert self.tier_io is not None
                future = self.tier_io.write(write.keys, write.host_slots, write.lower_slots, write.snapshot)
        except Exception:  # a refused write leaves nothing loadable below
            logger.exception("kvhal: write job %d to the lower tier was refused", write.job_id)
            self.reports.ended(write.job_id, ok=False)
            return
        self._writes[write.job_id] = (write, future)

    def _poll_tier(self, wait: bool = False, deadline: float = math.inf) -> int:
        """Finish the lower tier's reads and writes that completed (all of them if ``wait``,
        up to ``deadline``): how many had not ended by then (reported failed)."""
        stuck = 0
        for job_id, (write, future) in list(self._writes.items()):
            if wait or future.done():
                del self._writes[job_id]
                stuck += not _ends_by(future, deadline)
                written = _result(future, len(write.keys), False)
                ok = all(written)
                self.reports.ended(job_id, ok)
                self.stats.add_tier(
                    "tier_written_bytes", self._tier_name(write.remote), sum(written) * self.config.slot_bytes
                )
        now = time.monotonic()
        for job_id, reading in list(self._reads.items()):
            job = reading.job
            if not (wait or all(future.done() for _, _, future in reading.reads)):
                if reading.deadline is not None and now > reading.deadline and not reading.gave_up:
                    reading.gave_up = True
                    stalled = sorted(
                        {self._tier_name(remote) for _, remote, f in reading.reads if not f.done()}
                    )
                    for tier in stalled:
                        self.stats.add_tier("tier_load_timeouts", tier, 1)
                    logger.warning(
                        "kvhal: load job %d: the %s tier did not answer by its deadline; recomputing",
                        job_id,
                        " and ".join(stalled),
                    )
                    self.reports.give_up(job)
                continue
            del self._reads[job_id]
            failures: list[str] = []
            for reads, remote, future in reading.reads:
                stuck += not _ends_by(future, deadline)
                outcomes = _result(future, len(reads.keys), ReadOutcome.IO_ERROR)
                tier = self._tier_name(remote)
                for outcome in outcomes:
                    if outcome is not OK:
                        self.stats.add_tier(READ_FAILURE_COUNTERS[outcome], tier, 1)
                        failures.append(f"{tier} {outcome.value}")
                good = outcomes.count(OK)
                self.stats.add_tier("tier_read_bytes", tier, good * self.config.slot_bytes)
            if not failures and not wait and not reading.gave_up:
                self._submit(job)  # now a load of host slots, as any hit
                continue
            if reading.gave_up:  # vLLM was told; now the job ends and its host slots are released
                self.reports.ended(job_id, ok=False)
                continue
            total = sum(len(reads.keys) for reads, _, _ in reading.reads)
            logger.warning(
                "kvhal: load job %d: %d of %d blocks from the tiers below failed (%s); recomputing",
                job_id,
                len(failures),
                total,
                ", ".join(sorted(set(failures))) or "shutting down",
            )
            self._running[job_id] = _Running(job, set(), ok=False)
            self._finish(job_id)
        return stuck

    def _tier_name(self, remote: bool) -> str:
        """The name a tier below counts under: the remote tier's, or the lower tier's."""
        if remote:
            return remote_tier_name(self.config)
        return lower_tier_name(self.config)

    def take_stats(self, send: bool) -> KVHALStats | None:
        """This step's counters for vLLM, or None to keep them for a later step: when the
        scheduler side says the step has no request outputs (``send`` False), or a load failed
        in it (its request is skipped, perhaps the only one)."""
        failed = self.reports.take_load_failed()
        if not send or (failed and STATS_NEED_REQUEST_OUTPUTS):
            return None
        return self.stats.take()

    def take_load_errors(self) -> set[int]:
        """Device blocks loads failed to fill since the last call (vLLM recomputes): synchronous
        loads', and asynchronous ones' where vLLM takes no request-level failure."""
        return self.reports.take_load_errors()

    @property
    def jobs_in_flight(self) -> int:
        """Load, store and lower-tier jobs submitted and not yet finished on this worker."""
        return len(self._running) + len(self._reads) + len(self._writes)

    def worker_meta(self) -> KVHALWorkerMetadata | None:
        """The jobs finished since the last call, for the scheduler side (``None`` if none)."""
        return self.reports.worker_meta()

    def shutdown(self) -> None:
        """Wait for every copy in flight (none may write a freed buffer), then free the tier.
        Reads and writes of the tiers below are waited for up to :data:`SHUTDOWN_WAIT_S`; one
        still running then keeps its host memory and its tier as they are (leaked, not freed
        under it) and the shutdown goes on."""
        if self.engine is not None:
            for result in self.engine.wait():
                self._on_result(result)  # a finished store starts its write-through
        stuck = self._poll_tier(wait=True, deadline=time.monotonic() + SHUTDOWN_WAIT_S)
        if self.config.engine_id is not None:
            local.withdraw(self.config.engine_id, self)
        if stuck:
            logger.warning(
                "kvhal: %d reads or writes of the tiers below did not end within %.0f s of shutdown; "
                "their host memory and tiers are left open (freed, a late read would land in freed "
                "memory)",
                stuck,
                SHUTDOWN_WAIT_S,
            )
            self.lower_backend = self.tier_io = self.remote = self.host_tier = None
            self.host_views.clear()
            return
        if self.lower_backend is not None:
            self.lower_backend.close()
            self.lower_backend = self.tier_io = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.host_tier is not None:
            self.host_views.clear()
            self.host_tier.close()
            self.host_tier = None


T = TypeVar("T")


def _ends_by(future: Future[Any], deadline: float) -> bool:
    """Whether ``future`` is done by ``deadline`` (waiting for it until then)."""
    with contextlib.suppress(Exception):  # a timeout, or the future's own exception
        future.exception(timeout=max(0.0, deadline - time.monotonic()) if deadline < math.inf else None)
    return future.done()


def _result(future: Future[list[T]], count: int, failed: T) -> list[T]:
    """A tier future's per-block results; ``failed`` for each if it raised (logged) or has
    not ended (a shutdown's deadline passed)."""
    if not future.done():
        return [failed] * count
    try:
        return future.result()
    except Exception:
        logger.exception("kvhal: a lower-tier job raised")
        return [failed] * count


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0
