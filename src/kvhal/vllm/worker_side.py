"""The worker-side half of KVHALConnector: the device plugin, the host tier, the copies.

On ``register_kv_caches`` it picks the kvhal device plugin for the device the
engine's KV cache lives on (or the one the user named), wraps each offloaded
KV cache group's layer tensors (one tensor per layer, a (K, V) pair as
vllm-ascend passes, or another shape :mod:`kvhal.vllm.cache_shapes` takes) as a
:class:`~kvhal.cache.KVCache`, lays the same group geometry over one pinned host buffer,
and opens its share of every tier below the host tier (:mod:`kvhal.vllm.tier_list`).

Nothing here waits for a copy on the engine's thread except a fence the
scheduler asked for and a synchronous load: a host hit vLLM scheduled in this
step is submitted before the forward, and the compute stream waits for it (on
a device with streams the thread does not; on the CPU it waits for the copy).
A failed one is reported as invalid blocks, which vLLM recomputes; a large one may
be copied layer by layer (:mod:`kvhal.vllm.layer_gate`).
Asynchronous loads are polled: a request parked for its load is reported in
the step its load is found done. Stores are submitted after the forward, ordered after its
compute by the device facade, and overlap the following steps; the compute stream
waits only for the stores the step's metadata names (their blocks may be
rewritten), and a finished request the scheduler held is reported in
``finished_sending`` once this worker's stores of it finished. What it has yet to
report, to vLLM and to the scheduler side, is kept in a
:class:`~kvhal.vllm.worker_reports.WorkerReports`.

Every job in flight is one :class:`Running` in one table, whatever its kind
(:mod:`kvhal.vllm.metadata`): a load first reads the blocks that tiers below hold into
host slots (on the tiers' threads, polled like any copy), then copies them; a read job (a
prefetch) only reads; a store copies, then starts its write-throughs; a write moves host
slots to its tier. A load whose reads take longer than its tiers' wait is reported failed
to vLLM at once (the request is recomputed), while its host slots stay reserved until the
reads really end, so a late reply never lands in a reused slot.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.offload.host_tier import HostTier
from kvhal.offload.transfer import TransferEngine, TransferResult
from kvhal.tiers.backend import OK, ReadOutcome
from kvhal.tiers.chain import TierRead
from kvhal.vllm.config import ConnectorConfig, LowerTierConfig
from kvhal.vllm.engine_traits import EngineTraits
from kvhal.vllm.layer_gate import LayerGate
from kvhal.vllm.metadata import KVHALMetadata, KVHALWorkerMetadata, LoadJob, StoreJob, WriteJob
from kvhal.vllm.stats import READ_FAILURE_COUNTERS, KVHALStats
from kvhal.vllm.tier_list import TierReadWrite, ends_by, load_wait_s, open_worker_tiers, result_of
from kvhal.vllm.trace import TraceRecorder, WorkerObserver
from kvhal.vllm.worker_jobs import Running, on_engine_thread, submit_copies
from kvhal.vllm.worker_reports import WorkerReports
from kvhal.vllm.worker_setup import wrap_caches

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

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


@dataclass
class WorkerSide:
    """Worker-side state of one engine's connector."""

    config: ConnectorConfig
    stats: KVHALStats = field(default_factory=KVHALStats)
    #: what the vLLM served does (None: the installed vLLM's; ``kvhal replay``: the trace's)
    traits: EngineTraits | None = None

    def __post_init__(self) -> None:
        if self.traits is None:
            self.traits = EngineTraits.installed()
        self.device: Device | None = None
        self.host_tier: HostTier | None = None
        self.engine: TransferEngine | None = None
        self.caches: dict[int, KVCache] = {}
        self.host_views: dict[int, KVCache] = {}
        self.tiers: dict[str, TierReadWrite] = {}  # the tiers below, by name
        self._jobs: dict[int, Running] = {}  # every job in flight, by id
        self._job_of_copy: dict[int, list[int]] = {}  # a device copy's jobs (the index of Running.copies)
        self.reports = WorkerReports(self.traits)  # what this worker has yet to report
        self._stores_started: KVHALMetadata | None = None  # the step whose stores were submitted
        self._idle = False  # this step computes nothing and no request waits (KVHALMetadata.idle)
        self.layer_gate = LayerGate(self.config)  # large synchronous loads, layer by layer
        self.busy_seconds = 0.0
        #: who watches this worker's calls: a trace recorder (``KVHAL_TRACE_DIR``), the replay
        self.observer = WorkerObserver()

    # -- set-up ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any], rank: int = 0, device: Device | None = None) -> None:
        """Wrap the engine's KV cache, allocate the host tier and open the tiers below.

        :param kv_caches: per layer name, a logical ``[B, H, N, C]`` tensor, a
            ``(k_cache, v_cache)`` pair of them (split K and V, as vllm-ascend has; of other
            sizes or dtypes too), or a 1-tuple ``(k_cache,)``; :mod:`kvhal.vllm.cache_shapes`
            says which shapes are offloaded and which refused.
        :param rank: this worker's tensor-parallel rank (the connector passes vLLM's).
        :param device: the device plugin, bound (default: selected for the caches' device).
        :raises ValidationError: a layer is missing or of a shape kvhal refuses, or its blocks
            do not hold the bytes vLLM's KV cache spec says (naming the layer).
        """
        self.device, self.caches, self.host_tier, self.host_views = wrap_caches(
            self.config, kv_caches, device
        )
        if type(self.observer) is WorkerObserver:  # none given: a recorder, if asked for
            assert self.traits is not None
            self.observer = TraceRecorder.from_env(self.traits, self.config.engine_id, rank) or self.observer
        self.observer.registered(self.config, kv_caches, rank)
        for group in self.config.groups:
            self.layer_gate.add_group(group, self.caches[group.group_id], self.host_views[group.group_id])
        self.engine = TransferEngine(self.device)
        self.tiers = open_worker_tiers(self.config, self.stats, self.host_tier, rank)
        logger.info(
            "kvhal: device plugin %r (%s), %d host slots of %d bytes, pinned=%s",
            self.device.plugin_name,
            self.device.distribution,
            self.config.num_slots,
            self.config.slot_bytes,
            self.host_tier.is_pinned,
        )

    def read_tier(self, read: TierRead) -> Future[list[ReadOutcome]]:
        """Start ``read`` (blocks of one tier into host slots); for the in-process scheduler
        side's prefetch (:mod:`kvhal.vllm.local`), which no step's metadata carries."""
        self.observer.call("read_tier", read)
        return self._read_tier(read)

    def _read_tier(self, read: TierRead) -> Future[list[ReadOutcome]]:
        return self.tiers[read.tier].read(read.keys, read.slots, read.host_slots, read.positions)

    # -- per step -----------------------------------------------------------------

    @on_engine_thread
    def begin_step(self, meta: KVHALMetadata) -> None:
        """Before the step's compute: fence the stores whose blocks it may rewrite,
        and take note of the finished requests the scheduler holds for their stores."""
        self.observer.begin(meta)
        if self.engine is not None and meta.fence:
            copies = [c for j in meta.fence if j in self._jobs for c in self._jobs[j].copies]
            self.engine.fence(self.device.current_stream(), copies)
        for write in meta.writes:  # first: a write-back snapshots slots this step reuses
            self._start_write(write)
        for job in meta.prefetches:  # before the forward: the reads overlap it
            self._start_reads(Running(job), job.reads)
        self._idle = meta.idle
        for req_id in meta.held:
            self.reports.hold(req_id)

    @on_engine_thread
    def start_loads(self, meta: KVHALMetadata) -> None:
        """Submit this step's loads (host tier -> KV cache), reading blocks from the tiers
        below first; :meth:`collect` reports them. The compute stream waits for the
        synchronous ones: vLLM runs their requests in this step's forward."""
        self.observer.call("loads")
        by_layer: list[LoadJob] = []
        plain: list[Running] = []
        for job in meta.loads:
            running = Running(job)
            if job.doomed:
                self._jobs[job.job_id] = running
                self._finish(running, ok=False)
            elif job.reads:
                self._start_reads(running, job.reads)
            elif job.sync and self.layer_gate.takes(job, self.device):
                by_layer.append(job)
            else:
                plain.append(running)
        # the synchronous ones apart: the compute stream waits for their copies alone
        for batch in ([r for r in plain if r.sync], [r for r in plain if not r.sync]):
            if batch:
                self._submit(batch)
        sync_copies = list(dict.fromkeys(c for r in plain if r.sync for c in r.copies))
        if by_layer:
            self._submit_by_layer(by_layer)
        if sync_copies:
            assert self.engine is not None and self.device is not None
            self.engine.order_after(self.device.current_stream(), sync_copies)

    def _submit_by_layer(self, jobs: list[LoadJob]) -> None:
        """Submit synchronous loads layer by layer (:class:`~kvhal.vllm.layer_gate.LayerGate`):
        the attention of each layer waits for its copies only, in :meth:`wait_for_layer`."""
        assert self.engine is not None
        self.stats.add("layerwise_loads", len(jobs))
        copies, refused = self.layer_gate.submit(self.engine, jobs)
        for job in jobs:
            running = self._jobs[job.job_id] = Running(job, copies[job.job_id], ok=job.job_id not in refused)
            for copy in running.copies:
                self._job_of_copy.setdefault(copy, []).append(job.job_id)
            if not running.copies:
                self._finish(running, running.ok)

    def layer(self, name: str) -> None:
        """vLLM's attention of layer ``name`` is about to run (``wait_for_layer_load``)."""
        self.observer.call("layer", name)
        if not self.layer_gate.settled():
            self.wait_for_layer(name)

    @on_engine_thread
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
                for job_id in self._job_of_copy.get(copy, ()):
                    running = self._jobs.get(job_id)
                    if running is not None:
                        running.ok = False
            assert self.engine is not None and self.device is not None
            self.engine.order_after(self.device.current_stream(), left)

    def _start_reads(self, running: Running, reads: list[TierRead]) -> None:
        """Start a load's or a read job's reads of the tiers below into host slots. A load
        waits for them at most its tiers' wait; a read job (a prefetch) for a store at most
        the store's load timeout (the scheduler side waits no longer for a local tier)."""
        job = running.job
        self._jobs[job.job_id] = running
        waited = [r.tier for r in reads if isinstance(job, LoadJob) or not self._is_local(r.tier)]
        if waited:
            running.deadline = time.monotonic() + load_wait_s(self.config, waited)
        try:
            for read in reads:
                running.reads[read.tier] = (read, self._read_tier(read))
        except Exception:  # a refused read fails the load; vLLM recomputes
            logger.exception("kvhal: job %d: reading a tier below was refused", job.job_id)
            if not running.reads:
                self._finish(running, ok=False)
                return
            self._give_up(running)  # the reads started must end before their slots are released

    def _is_local(self, name: str) -> bool:
        return any(tier.name == name and isinstance(tier, LowerTierConfig) for tier in self.config.tiers)

    def _give_up(self, running: Running) -> None:
        running.gave_up = True
        if isinstance(running.job, LoadJob):  # vLLM waits for no read job: the scheduler does
            self.reports.give_up(running.job)

    @on_engine_thread
    def start_stores(self, meta: KVHALMetadata) -> None:
        """Submit this step's stores (KV cache -> host tier), ordered after the step's compute;
        once per step (a step without a forward submits them with its loads)."""
        if meta is self._stores_started:
            return
        self._stores_started = meta
        self.observer.call("stores")
        self._end_forward()
        for job in meta.stores:
            self.reports.store_started(job)
            self.observer.stored(job, self.caches)
        if meta.stores:
            self._submit([Running(job) for job in meta.stores])

    def _submit(self, runnings: list[Running]) -> None:
        """Submit loads' or stores' device copies, all of them at once (:func:`submit_copies`)."""
        assert self.engine is not None
        jobs = [running.job for running in runnings]
        copies, refused = submit_copies(self.engine, self.caches, self.host_views, jobs)  # type: ignore[arg-type]
        for running in runnings:
            job_id = running.job.job_id
            self._jobs[job_id] = running
            running.copies |= copies[job_id]
            running.ok &= job_id not in refused
            for copy in copies[job_id]:
                self._job_of_copy.setdefault(copy, []).append(job_id)
            if not running.copies:
                self._finish(running, running.ok)

    def _onresult_of(self, result: TransferResult) -> None:
        for job_id in self._job_of_copy.pop(result.job_id):  # a step's jobs share a copy
            running = self._jobs[job_id]
            running.copies.discard(result.job_id)
            running.ok &= result.success
            if not result.success:
                logger.warning("kvhal: job %d failed: %s", job_id, result.error)
            if not running.copies:
                self._finish(running, running.ok)

    def _finish(self, running: Running, ok: bool) -> None:
        """End a job here: report it, and what follows from its kind."""
        job = running.job
        del self._jobs[job.job_id]
        self.reports.ended(job.job_id, ok)
        self.observer.ended(job, ok, self.caches, self.host_views)
        if isinstance(job, LoadJob):
            self.reports.load_ended(job, ok, job.sync)
            if ok and job.num_blocks:
                # Bytes are counted where they move: each tensor-parallel worker copies its
                # own share, and vLLM sums the workers' stats. Blocks are counted once,
                # scheduler-side.
                self.stats.add("loaded_bytes", job.num_blocks * self.config.slot_bytes)
        elif isinstance(job, StoreJob):
            if ok:
                self.stats.add("stored_bytes", job.num_blocks * self.config.slot_bytes)
            for write in job.writes:
                self._start_write(write, stored=ok)
            self.reports.store_ended(job)

    @on_engine_thread
    def collect(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose loads finished, whose loads failed (a subset), and whose
        held blocks the stores read no more; polls, never waits for a copy (but in an idle
        step, up to :data:`IDLE_WAIT_S` for one of its jobs to end)."""
        assert self.engine is not None or not self._jobs
        self._poll()
        if self._idle and self.jobs_in_flight:
            deadline = time.monotonic() + IDLE_WAIT_S
            while not self.reports.has_news() and self.jobs_in_flight and time.monotonic() < deadline:
                time.sleep(IDLE_POLL_S)
                self._poll()
        finished = self.reports.take_requests()
        self.observer.call("collect", finished)
        return finished

    def _poll(self) -> None:
        self._poll_tiers()
        if self.engine is not None:
            # A synchronous load is reported in its own step: the forward waited for its
            # copy, so this wait is for an event already complete (or failed).
            pending = [c for r in self._jobs.values() if r.sync for c in r.copies]
            for result in self.engine.wait(pending) if pending else ():
                self._onresult_of(result)
            for result in self.engine.poll():
                self._onresult_of(result)

    def _start_write(self, write: WriteJob, stored: bool = True) -> None:
        """Submit a write to its tier; a write-through whose store failed fails unrun."""
        running = self._jobs[write.job_id] = Running(write)
        if not stored:
            self._finish(running, ok=False)
            return
        try:
            running.write = self.tiers[write.tier].write(
                write.keys, write.host_slots, write.slots, write.snapshot, write.positions
            )
        except Exception:  # a refused write leaves nothing loadable below
            logger.exception("kvhal: write job %d to the %s tier was refused", write.job_id, write.tier)
            self._finish(running, ok=False)

    def _poll_tiers(self, wait: bool = False, deadline: float = math.inf) -> int:
        """Finish the tiers' reads and writes that completed (all of them if ``wait``, up to
        ``deadline``): how many had not ended by then (reported failed)."""
        stuck = 0
        now = time.monotonic()
        for running in [r for r in self._jobs.values() if r.write is not None or r.reads]:
            futures = [f for _, f in running.reads.values()] + ([running.write] if running.write else [])
            if not (wait or all(f.done() for f in futures)):
                if running.deadline is not None and now > running.deadline and not running.gave_up:
                    stalled = sorted(name for name, (_, f) in running.reads.items() if not f.done())
                    for name in stalled:
                        self.stats.add_tier("tier_load_timeouts", name, 1)
                    logger.warning(
                        "kvhal: job %d: the %s tier did not answer by its deadline; recomputing",
                        running.job.job_id,
                        " and ".join(stalled),
                    )
                    self._give_up(running)
                continue
            stuck += sum(not ends_by(f, deadline) for f in futures)
            if running.write is not None:
                self._write_ended(running)
            else:
                self._reads_ended(running, shutting_down=wait)
        return stuck

    def _write_ended(self, running: Running) -> None:
        job = running.job
        assert isinstance(job, WriteJob) and running.write is not None
        written = result_of(running.write, len(job.keys), False)
        self.stats.add_tier("tier_written_bytes", job.tier, sum(written) * self.config.slot_bytes)
        self._finish(running, all(written))

    def _reads_ended(self, running: Running, shutting_down: bool) -> None:
        """A load's or a read job's reads ended: a load whose reads all succeeded is now a load
        of host slots (its copies are submitted), anything else ends here."""
        failures: list[str] = []
        for name, (read, future) in running.reads.items():
            outcomes = result_of(future, len(read.keys), ReadOutcome.IO_ERROR)
            for outcome in outcomes:
                if outcome is not OK:
                    self.stats.add_tier(READ_FAILURE_COUNTERS[outcome], name, 1)
                    failures.append(f"{name} {outcome.value}")
            self.stats.add_tier("tier_read_bytes", name, outcomes.count(OK) * self.config.slot_bytes)
        reads, running.reads = running.reads, {}
        if not failures and not shutting_down and not running.gave_up:
            if isinstance(running.job, LoadJob):
                self._submit([running])  # now a load of host slots, as any hit
            else:
                self._finish(running, ok=True)
            return
        if failures and isinstance(running.job, LoadJob):
            logger.warning(
                "kvhal: load job %d: %d of %d blocks from the tiers below failed (%s); recomputing",
                running.job.job_id,
                len(failures),
                sum(len(read.keys) for read, _ in reads.values()),
                ", ".join(sorted(set(failures))),
            )
        if running.gave_up:  # vLLM was told; now the job ends and its host slots are released
            del self._jobs[running.job.job_id]
            self.reports.ended(running.job.job_id, ok=False)
            return
        self._finish(running, ok=False)

    def take_stats(self, send: bool) -> KVHALStats | None:
        """This step's counters for vLLM, or None to keep them for a later step: when the
        scheduler side says the step has no request outputs (``send`` False), or a load failed
        in it (its request is skipped, perhaps the only one)."""
        failed = self.reports.take_load_failed()
        self.observer.call("stats", send)
        if not send or (failed and self.traits.stats_need_request_outputs):
            return None
        return self.stats.take()

    def take_load_errors(self) -> set[int]:
        """Device blocks loads failed to fill since the last call (vLLM recomputes): synchronous
        loads', and asynchronous ones' where vLLM takes no request-level failure."""
        errors = self.reports.take_load_errors()
        self.observer.call("load_errors", errors)
        return errors

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted and not yet finished on this worker, of every kind."""
        return len(self._jobs)

    def worker_meta(self) -> KVHALWorkerMetadata | None:
        """The jobs finished since the last call, for the scheduler side (``None`` if none)."""
        meta = self.reports.worker_meta()
        self.observer.call("worker_meta", meta)
        return meta

    def shutdown(self) -> None:
        """Wait for every copy in flight (none may write a freed buffer), then free the tiers.
        Reads and writes of the tiers below are waited for up to :data:`SHUTDOWN_WAIT_S`; one
        still running then keeps its host memory and its tier as they are (leaked, not freed
        under it) and the shutdown goes on."""
        self.observer.call("shutdown")
        try:
            self._shutdown()
        finally:
            self.observer.close()

    def _shutdown(self) -> None:
        if self.engine is not None:
            for result in self.engine.wait():
                self._onresult_of(result)  # a finished store starts its write-through
        stuck = self._poll_tiers(wait=True, deadline=time.monotonic() + SHUTDOWN_WAIT_S)
        if stuck:
            logger.warning(
                "kvhal: %d reads or writes of the tiers below did not end within %.0f s of shutdown; "
                "their host memory and tiers are left open (freed, a late read would land in freed "
                "memory)",
                stuck,
                SHUTDOWN_WAIT_S,
            )
            self.tiers = {}
            self.host_tier = None
            self.host_views.clear()
            return
        for tier in self.tiers.values():
            tier.close()
        self.tiers = {}
        if self.host_tier is not None:
            self.host_views.clear()
            self.host_tier.close()
            self.host_tier = None
