"""The scheduler-side half of KVHALConnector: what the host tier holds, what to load and store.

It owns the :class:`~kvhal.offload.manager.OffloadingManager` and never touches KV
bytes. Per step: lookups (``get_num_new_matched_tokens``) find the longest
prefix of a request's blocks that every offloaded KV cache group holds. A
hit held whole in the host tier is loaded synchronously: vLLM schedules the
request in the same step, the workers copy before the forward and the forward
waits for the copy, and a failed copy is reported as invalid blocks that vLLM
recomputes. Other hits (fetched from the store, read from a tier below
without a prefetch, or any hit of a model with several KV cache groups, whose
failed loads vLLM can recompute only when they are asynchronous) are loaded
asynchronously: vLLM parks the request until the workers report the load.
Blocks that become full during a step are stored by the workers right after
it. Job results come back through the workers' metadata (counted per job in a
:class:`~kvhal.vllm.job_table.JobTable`) and complete the manager's loads and stores.

Stores run while later steps compute. A store's source blocks must not be
rewritten before it has read them, so: a finished request with stores in
flight keeps its blocks (``request_finished`` returns True) until every
worker reports it in ``finished_sending``; and each step's metadata names the
stores whose blocks vLLM may rewrite in that step (the request was preempted,
or a block was allocated again, as sliding-window blocks are while their
request runs) for the workers to fence (:mod:`kvhal.vllm.fences`). No other
store delays a step. The host tier's changes reach vLLM as KV events
(:mod:`kvhal.vllm.kv_events`).

With a tier below host memory (``disk_path``, or a plugin's backend), a
:class:`~kvhal.tiers.chain.TierChain` holds both tiers' indexes: a hit found
below is prefetched at lookup (:mod:`kvhal.vllm.prefetch`: read into host slots
while vLLM is answered ``None``), then loaded as a host hit; without a prefetch
the load job itself reads, then copies. Stores cascade into the lower tier as
write jobs the workers run off the engine's thread.

With a remote tier shared by a fleet (``remote_url``), a lookup that the local
tiers end short asks the store whether it holds the following blocks
(:mod:`kvhal.vllm.store_lookup`). Blocks the store holds are prefetched as the
lower tier's are (with their own wait policy), then loaded as a host hit; where
no prefetch is made (budget, room) the load job reads them, then copies. Every
block stored to the host tier is written to the store too, unless
``remote_max_inflight_blocks`` are being written already or the store is down:
then it is dropped, counted.

What it keeps per request is a :class:`~kvhal.vllm.request_state.RequestState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvhal.errors import ValidationError
from kvhal.offload.manager import OffloadingManager
from kvhal.offload.wait_policy import StepTimes, WaitPolicy
from kvhal.tiers.backend import TierBackend
from kvhal.tiers.chain import LoadPlan, TierChain, WritePlan
from kvhal.tiers.index import TierIndex
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.fences import StoreFences
from kvhal.vllm.job_table import JobTable
from kvhal.vllm.keys import offload_key
from kvhal.vllm.kv_events import kv_events
from kvhal.vllm.lower_tier import lower_tier_name, open_lower_tier
from kvhal.vllm.metadata import (
    JobKind,
    KVHALMetadata,
    KVHALWorkerMetadata,
    TierReads,
    TierWrite,
    TransferJob,
)
from kvhal.vllm.prefetch import Prefetcher, Started
from kvhal.vllm.remote import open_remote_tier, remote_tier_name
from kvhal.vllm.request_state import RequestState
from kvhal.vllm.stats import KVHALStats
from kvhal.vllm.store_lookup import lookup_store
from kvhal.vllm.versions import STATS_NEED_REQUEST_OUTPUTS, BlockTables, failed_recving

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level

#: The key of ``RequestOutput.kv_transfer_params`` that says how many prompt
#: tokens kvhal loaded for the request (0 after a failed load).
LOADED_TOKENS = "kvhal_loaded_tokens"


def _log_recovery(done: int, total: int) -> None:
    """Progress of a warm restart's index rebuild (the backend calls it now and then)."""
    logger.info("kvhal: recovering the lower tier's index: %d of %d slots read", done, total)


@dataclass
class _Quarantine:
    """A failed store's host slots, kept taken until every rank reported its writes."""

    keys: list[bytes]
    writes: set[int]


@dataclass
class SchedulerSide:
    """Scheduler-side state of one engine's connector."""

    config: ConnectorConfig
    manager: OffloadingManager = field(init=False)
    stats: KVHALStats = field(default_factory=KVHALStats)

    def __post_init__(self) -> None:
        self.lower_backend: TierBackend | None = None
        self.remote: RemoteTier | None = None
        # the tiers' names, their counters' ``tier`` label
        self.lower_name = lower_tier_name(self.config) if self.config.lower_tier else "lower"
        self.remote_name = remote_tier_name(self.config) if self.config.remote_tier else "remote"
        if self.config.remote_tier is not None:
            self.remote = open_remote_tier(self.config, role="index", rank=0, stats=self.stats)
        self._remote_writing = 0  # blocks being written to the remote tier
        self.manager, self.chain = self._new_chain()
        self._requests: dict[str, RequestState] = {}
        self._block_tables = BlockTables()  # device blocks per request (vLLM 0.32 hands its own)
        self._hold_stats = False  # keep this step's counters for the next (see take_stats)
        self._send_stats = True  # the last scheduled step's KVHALMetadata.send_stats
        self.jobs = JobTable(self.config.world_size)
        self._storing: set[bytes] = set()
        self._pending_loads: list[TransferJob] = []
        lower, remote = self.config.lower_tier, self.config.remote_tier
        self._step_times = StepTimes()  # the engine's compute rate, one for every tier's policy
        self.wait_policy = (
            WaitPolicy(lower.wait_ms, lower.wait_policy, steps=self._step_times)
            if lower is not None and lower.wait_ms is not None
            else None
        )
        self.remote_wait = (
            WaitPolicy(remote.load_timeout_ms, remote.wait_policy, steps=self._step_times) if remote else None
        )
        self.prefetcher = Prefetcher(
            self.config,
            self.stats,
            self.wait_policy,
            self.remote_wait,
            self.jobs.new_prefetch,
            (self.lower_name, self.remote_name),
        )
        self._last_step: tuple[float, int] | None = None  # the last step's start, its tokens
        self.fences = StoreFences(self.config.block_size, self.stats)  # the stores a step may overwrite
        self._quarantined: dict[int, _Quarantine] = {}  # write job id -> the failed store it reads
        self._held: list[str] = []  # finished requests to announce to the workers
        self._holding: set[str] = set()  # held requests not yet reported in finished_sending

    # -- lookups and loads -----------------------------------------------------

    def track(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        return state

    def _new_chain(self) -> tuple[OffloadingManager, TierChain]:
        """The host tier's manager and the chain over it and the lower tier, if any.

        The lower tier's backend is opened once (the scheduler owns its medium
        for the engine's life) and what it holds is recovered into the index.
        """
        manager = OffloadingManager(self.config.num_slots, self.config.eviction_policy, enable_events=True)
        lower = self.config.lower_tier
        if lower is None:
            return manager, TierChain(manager)
        if self.lower_backend is None:
            self.lower_backend = open_lower_tier(self.config, role="index", rank=0)
            index = TierIndex(self.lower_backend.num_slots, lower.eviction_policy)
            slots, keys = self.lower_backend.recover(progress=_log_recovery)
            if keys:  # a key found twice after a crash is indexed once
                self.stats.add_tier("tier_recovered_blocks", self.lower_name, index.recover(slots, keys))
        else:  # a reset: forget what the lower tier holds too
            index = TierIndex(self.lower_backend.num_slots, lower.eviction_policy)
        return manager, TierChain(manager, index, lower.write)  # type: ignore[arg-type]

    def _keys(self, hashes: list[bytes], group_id: int) -> list[bytes]:
        return [offload_key(h, group_id) for h in hashes]

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` kvhal can load, block-aligned and
        short of the last prompt token (vLLM computes at least one); ``None``
        while a store that would extend the hit is still in flight."""
        state = self.track(request)
        if state.load_failed:  # offering the same hit again would loop (the load failed)
            return 0, False
        self.prefetcher.poll_local_reads(self.chain)
        if state.prefetch is not None:
            if not state.prefetch.done and time.monotonic() < state.prefetch.deadline:
                return None, False  # the request holds no device blocks meanwhile
            if not state.prefetch.done:  # past the wait: what is in host memory now is the hit
                self.stats.add_tier("tier_prefetch_timeouts", self._tier_name(state.prefetch.remote), 1)
            state.prefetch = None
        bs = self.config.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        hashes = list(request.block_hashes[start:end])
        hit = len(hashes)
        below = False  # part of the hit must be read from a tier below first
        for group in self.config.groups:
            if hit == 0:
                break
            keys = self._keys(hashes[:hit], group.group_id)
            found, promoted = self.chain.lookup(keys)
            if found < hit and keys[found] in self._storing:
                return None, False
            hit = found
            below |= promoted > 0
        if below:
            if state.recompute_below:
                started = Started.RECOMPUTE
            else:
                started = self.prefetcher.start(self.chain, state, hashes[:hit])
            if started is Started.READ_NOW:  # read in this lookup: the blocks are host blocks now
                return self.lookup(request, num_computed_tokens)
            if started is Started.RECOMPUTE:  # the host tier's part of the hit, loaded as a host hit
                state.recompute_below = True
                hit, below = self.prefetcher.host_prefix(self.chain, hashes[:hit]), False
            elif started is Started.WAITING:
                return None, False
        if self.remote is not None and hit < len(hashes):
            more = lookup_store(
                self.remote, self.config, self.stats, self.chain, state, start, hashes, hit, self.remote_name
            )
            if more is None:
                return None, False
            if more and not below and state.remote_prefetched:
                more = 0  # its prefetch brought what it could into host memory: recompute the rest
            elif more and not below:
                started = self.prefetcher.start(self.chain, state, hashes[: hit + more], remote=True)
                if started is Started.READ_NOW:
                    return self.lookup(request, num_computed_tokens)
                if started is Started.RECOMPUTE:
                    more = 0
                elif started is Started.WAITING:
                    return None, False
            hit += more
            below |= more > 0
        state.hit_start, state.hit_blocks = start, hit
        state.hit_sync = hit > 0 and not below and self.config.sync_host_loads
        return hit * bs, hit > 0 and not state.hit_sync

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of a hit into the blocks vLLM just allocated."""
        if num_external_tokens == 0:
            return
        state = self.track(request)
        bs = self.config.block_size
        count = num_external_tokens // bs
        if state.hit_blocks < count:
            raise ValidationError(
                "num_external_tokens", f"{count} blocks allocated for a hit of {state.hit_blocks} blocks"
            )
        table = blocks.get_block_ids()
        hashes = request.block_hashes
        group_ids: dict[int, list[int]] = {}
        keys: list[bytes] = []
        block_of: dict[bytes, int] = {}
        for group in self.config.groups:
            ids = group_ids[group.group_id] = []
            for index in range(state.hit_start, state.hit_start + count):
                block_id = table[group.group_id][index]
                if block_id == 0:  # outside a sliding window: nothing to load
                    continue
                ids.append(block_id)
                key = offload_key(hashes[index], group.group_id)
                keys.append(key)
                block_of[key] = index
            self.fences.load_blocks.update(ids)
        plan = self.chain.prepare_load(keys, fetch=state.fetch)
        groups: dict[int, tuple[list[int], list[int]]] = {}
        reads = remote_reads = None
        if plan is None:
            # the host tier had no room left for the promotion since the lookup:
            # the job fails on the workers without copying, and vLLM recomputes
            groups = {gid: ([], []) for gid in group_ids}
        else:
            slots = iter(plan.host_slots)
            groups = {gid: (ids, [next(slots) for _ in ids]) for gid, ids in group_ids.items()}
            self.manager.touch(keys)
            prefetches = ((self.lower_name, state.from_below), (self.remote_name, state.from_store))
            for name, read in prefetches:
                prefetched = {block_of[k] for k in keys if k in read}
                if prefetched:  # a hit from a tier below, read into host memory at its lookup
                    self.stats.add_tier("tier_hit_tokens", name, len(prefetched) * bs)
            state.from_below, state.from_store = set(), set()
            if plan.promoted:
                reads = TierReads(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
                self.stats.add_tier(
                    "tier_hit_tokens", self.lower_name, len({block_of[k] for k in plan.promoted}) * bs
                )
            if plan.fetched:
                remote_reads = TierReads(plan.fetched, [], plan.fetched_host_slots)
                self.stats.add_tier(
                    "tier_hit_tokens", self.remote_name, len({block_of[k] for k in plan.fetched}) * bs
                )
        job = self.jobs.new(JobKind.LOAD, request.request_id, keys, groups, plan=plan)
        job.sync = state.hit_sync
        if job.sync:
            self.stats.add("sync_hit_tokens", num_external_tokens)
        job.reads = reads
        job.remote_reads = remote_reads
        job.doomed = plan is None
        self._pending_loads.append(job)
        state.loading = job.job_id
        state.loaded_tokens = num_external_tokens
        self.stats.add("hit_tokens", num_external_tokens)
        self.stats.add("lookup_tokens", (len(request.block_hashes) - state.hit_start) * bs)

    # -- stores ----------------------------------------------------------------

    def _plan_stores(self, scheduler_output: SchedulerOutput) -> list[TransferJob]:
        bs = self.config.block_size
        block_state = self._block_tables.update(scheduler_output)
        stores = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or block_state is None:
                continue
            request = state.request
            limit = request.num_prompt_tokens if self.config.offload_prompt_only else request.num_tokens
            full = min(request.num_computed_tokens + num_new, limit) // bs
            end = min(full, len(request.block_hashes))
            if end <= state.stored_upto:
                continue
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue
            where: dict[bytes, tuple[int, int]] = {}
            for group in self.config.groups:
                for index in range(state.stored_upto, end):
                    block_id = table[group.group_id][index]
                    if block_id != 0:
                        where[offload_key(request.block_hashes[index], group.group_id)] = (
                            group.group_id,
                            block_id,
                        )
            state.stored_upto = end
            slow = self.wait_policy is not None and self.wait_policy.slow
            planned = self.chain.prepare_store(list(where), below=not slow)
            if slow and planned is not None:
                self.stats.add_tier("tier_slow_skipped_writes", self.lower_name, len(planned[0].keys))
            if planned is None:
                self.stats.add("store_skipped_blocks", len(where))
                continue
            plan, write = planned
            self.stats.add("evicted_blocks", len(plan.evicted))
            if not plan.keys:
                continue
            groups: dict[int, tuple[list[int], list[int]]] = {}
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                group_id, block_id = where[key]
                ids, slots = groups.setdefault(group_id, ([], []))
                ids.append(block_id)
                slots.append(slot)
            self._storing.update(plan.keys)
            job = self.jobs.new(JobKind.STORE, req_id, plan.keys, groups, plan=write)
            self.fences.add(job.job_id, self.jobs[job.job_id].blocks)
            if write is not None:
                job.write = self.jobs.new_write(write)
                self.jobs[job.job_id].writes.append(job.write.job_id)
            if self.remote is not None:
                # a block loaded from the remote tier is there already
                remote = self.chain.remote_write(plan, [k for k in plan.keys if k not in state.fetch])
                if remote is not None and self._admit_remote_write(len(remote.keys)):
                    self.jobs[job.job_id].remote = remote
                    job.remote_write = self.jobs.new_write(remote)
                    self.jobs[job.job_id].writes.append(job.remote_write.job_id)
            state.store_jobs.add(job.job_id)
            stores.append(job)
        return stores

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVHALMetadata:
        self.prefetcher.poll_local_reads(self.chain)  # an aborted request's read ends here
        self._time_steps(scheduler_output.total_num_scheduled_tokens)
        # fences first: this step's own stores are ordered after its compute anyway
        fence = self.fences.take(scheduler_output, self._requests)
        stores = self._plan_stores(scheduler_output)
        meta = KVHALMetadata(
            prefetches=self.prefetcher.take_jobs(),
            loads=self._pending_loads,
            stores=stores,
            fence=fence,
            held=self._held,
            writes=self._plan_writes(),  # after the stores: write-back snapshots their evictions
            idle=scheduler_output.total_num_scheduled_tokens == 0 and not self._requests,
            no_forward=scheduler_output.total_num_scheduled_tokens == 0,
        )
        # only where vLLM drops the stats of steps without request outputs: off the 0.32 path
        meta.send_stats = not STATS_NEED_REQUEST_OUTPUTS or self._samples(scheduler_output)
        self._send_stats = meta.send_stats
        self._pending_loads, self._held = [], []
        return meta

    def _samples(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a request of this step samples a token (computes up to its end): vLLM
        builds the metadata before it counts the step's tokens as computed."""
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or state.request.num_computed_tokens + num_new >= state.request.num_tokens:
                return True
        return False

    def _time_steps(self, tokens: int) -> None:
        """The engine's compute rate for the wait policy: a step's tokens over the time to the
        next step's schedule, while the engine is busy (an idle gap is not compute)."""
        now = time.monotonic()
        waits = self.wait_policy is not None or self.remote_wait is not None
        if waits and self._last_step is not None and tokens > 0:
            started, computed = self._last_step
            self._step_times.add(computed, now - started)
        self._last_step = (now, tokens) if tokens > 0 else None

    def _tier_name(self, remote: bool) -> str:
        return self.remote_name if remote else self.lower_name

    def _admit_remote_write(self, blocks: int) -> bool:
        """Whether ``blocks`` more may be written to the remote tier now (else dropped, counted)."""
        assert self.remote is not None and self.config.remote_tier is not None
        if not self.remote.up or self._remote_writing + blocks > self.config.remote_tier.max_inflight_blocks:
            self.stats.add_tier("tier_dropped_blocks", self.remote_name, blocks)
            return False
        self._remote_writing += blocks
        return True

    def _plan_writes(self) -> list[TierWrite]:
        """Write-back snapshots of the blocks this step's stores and promotions evicted."""
        writes = [self.jobs.new_write(plan) for plan in self.chain.take_writes()]
        self.stats.add_tier("tier_write_skipped_blocks", self.lower_name, self.chain.skipped_writes)
        self.stats.add_tier("tier_evicted_blocks", self.lower_name, self.chain.lower_evictions)
        self.chain.skipped_writes = self.chain.lower_evictions = 0
        return writes

    # -- results -----------------------------------------------------------------

    def on_output(self, output: KVConnectorOutput) -> None:
        worker_meta = output.kv_connector_worker_meta
        if isinstance(worker_meta, KVHALWorkerMetadata):
            # in job order: a store's write-through (a later job) ends after the store
            reports = [(j, n, True) for j, n in worker_meta.succeeded.items()]
            reports += [(j, n, False) for j, n in worker_meta.failed.items()]
            for job_id, count, ok in sorted(reports):
                self._report(job_id, count, ok=ok)
        self._holding.difference_update(output.finished_sending or ())
        for req_id in failed_recving(output):
            state = self._requests.get(req_id)
            if state is not None:
                state.load_failed = True
                state.loaded_tokens = 0

    def _report(self, job_id: int, count: int, ok: bool) -> None:
        job = self.jobs.report(job_id, count, ok)
        if job is None:  # other workers have yet to report it
            return
        state = self._requests.get(job.req_id)
        if job.kind is JobKind.WRITE:
            assert isinstance(job.plan, WritePlan)
            self.chain.complete_write(job.plan, success=job.ok)
            tier = self._tier_name(job.plan.remote)
            if job.plan.remote:
                self._remote_writing -= len(job.keys)
            if job.ok:
                self.stats.add_tier("tier_written_blocks", tier, len(job.keys))
            else:
                self.stats.add_tier("tier_failed_writes", tier, 1)
            quarantine = self._quarantined.pop(job_id, None)
            if quarantine is not None:
                quarantine.writes.discard(job_id)
                if not quarantine.writes:  # every rank's writes from the slots ended
                    self.chain.complete_store(quarantine.keys, success=False)
            return
        if job.kind is JobKind.STORE:
            self.fences.remove(job_id, job.blocks)
            if state is not None:
                state.store_jobs.discard(job_id)
            self._storing.difference_update(job.keys)
            write = job.plan if isinstance(job.plan, WritePlan) else None
            running = {w for w in job.writes if w in self.jobs}
            if not job.ok and running and self.config.world_size > 1:
                # A rank whose own share stored is writing it below from these host slots:
                # freed now, a new store could overwrite them mid-write (wrong KV below).
                quarantine = _Quarantine(job.keys, running)
                self._quarantined.update(dict.fromkeys(running, quarantine))
            else:
                self.chain.complete_store(job.keys, success=job.ok, write=write, remote=job.remote)
            if not job.ok:
                self.stats.add("failed_stores", 1)
            elif job.keys:  # once per block, however many workers copied a share of it
                self.stats.add("stored_blocks", len(job.keys))
        elif job.prefetch:
            assert isinstance(job.plan, LoadPlan)
            # timed to the step that reports it: an upper bound
            seconds = time.monotonic() - job.started
            self.prefetcher.end_read(self.chain, state, job_id, job.plan, job.ok, seconds)
        else:
            if state is not None and state.loading == job_id:
                state.loading = None
            if isinstance(job.plan, LoadPlan):  # None: the chain refused it, nothing to release
                self.chain.complete_load(job.plan, success=job.ok)
                if job.plan.promoted:
                    if job.ok:
                        self.stats.add_tier("tier_loaded_blocks", self.lower_name, len(job.plan.promoted))
                    else:
                        self.stats.add_tier("tier_failed_loads", self.lower_name, 1)
                if job.plan.fetched:
                    if job.ok:
                        self.stats.add_tier("tier_loaded_blocks", self.remote_name, len(job.plan.fetched))
                    else:
                        self.stats.add_tier("tier_failed_loads", self.remote_name, 1)
            if not job.ok:
                self.stats.add("failed_loads", 1)
                # its request may be this step's only one, and skipped: no request outputs
                self._hold_stats = STATS_NEED_REQUEST_OUTPUTS
                if state is not None:  # a synchronous load's request learns it here
                    state.load_failed = True
                    state.loaded_tokens = 0
            elif job.keys:
                self.stats.add("loaded_blocks", len(job.keys))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Mark the request's prompt blocks used (the eviction policy's recency).

        Returns True (vLLM keeps the request's blocks) while stores reading them
        are in flight; the workers then report the request in ``finished_sending``
        once those stores finished, failed ones included. A request whose load is
        in flight has no such store (it has not run since its blocks were
        allocated), and vLLM frees its blocks when the load is reported.
        """
        state = self._requests.pop(request.request_id, None)
        full = min(len(request.block_hashes), request.num_prompt_tokens // self.config.block_size)
        # block by block, every group's key: the manager makes the first key the most
        # recent, so a shared prefix outlives the tails behind it
        self.manager.touch(
            [offload_key(h, g.group_id) for h in request.block_hashes[:full] for g in self.config.groups]
        )
        hold = state is not None and bool(state.store_jobs) and state.loading is None
        if hold:
            self._held.append(request.request_id)
            self._holding.add(request.request_id)
            self.stats.add("held_requests", 1)
        return hold, {LOADED_TOKENS: state.loaded_tokens if state else 0}

    def take_events(self) -> list[KVCacheEvent]:
        """What the host tier stored and evicted since the last call, as vLLM's KV events."""
        return kv_events(self.manager.take_events(), self.config.block_size)

    def take_stats(self) -> KVHALStats | None:
        """This step's counters for vLLM, or None to carry them into the next step: where vLLM
        drops the stats of a step without request outputs, only a step in which a request
        samples a token sends them, and not one whose load failed (its request is skipped)."""
        if STATS_NEED_REQUEST_OUTPUTS:
            hold = self._hold_stats or not self._send_stats
            self._hold_stats = False
            if hold:
                return None
        return self.stats.take()

    def has_jobs_in_flight(self) -> bool:
        self.prefetcher.poll_local_reads(self.chain)
        return bool(self.jobs or self.prefetcher.local_reads)

    def has_held_blocks(self) -> bool:
        """Whether finished requests' blocks will be freed once their stores finish."""
        return bool(self._holding)

    def reset(self) -> bool:
        """Forget everything the host tier holds; refused (False) while jobs are in flight."""
        if self.has_jobs_in_flight():
            return False
        self.manager, self.chain = self._new_chain()
        for state in self._requests.values():
            state.stored_upto = 0
        return True

    def close(self) -> None:
        """Release the lower tier's medium (another engine may open it then), and the store."""
        if self.lower_backend is not None:
            self.lower_backend.close()
            self.lower_backend = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
