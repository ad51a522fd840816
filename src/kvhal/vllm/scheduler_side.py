"""The scheduler-side half of KVHALConnector: what the tiers hold, what to load and store.

It owns the host tier's :class:`~kvhal.offload.manager.OffloadingManager` and the
:class:`~kvhal.tiers.chain.TierChain` over it and the tiers below (``ConnectorConfig.tiers``,
opened by :mod:`kvhal.vllm.tier_list`), and never touches KV bytes. Per step: lookups
(``get_num_new_matched_tokens``) find the longest prefix of a request's blocks that every
offloaded KV cache group holds, in host memory or, past it, in the tiers below: a local
tier's index answers at once, the stores are asked (:mod:`kvhal.vllm.store_lookup`). A hit
held whole in the host tier is loaded synchronously: vLLM schedules the request in the same
step, the workers copy before the forward and the forward waits for the copy, and a failed
copy is reported as invalid blocks that vLLM recomputes. A hit partly below is prefetched
at lookup (:mod:`kvhal.vllm.prefetch`: read into host slots while vLLM is answered
``None``), then loaded as a host hit; where no prefetch is made (a tier without one, the
budget, room) it is loaded asynchronously: vLLM parks the request until the workers
report the load, which reads, then copies. Any hit of a model with several KV cache
groups loads asynchronously too (vLLM recomputes their failed loads only so).

Blocks that become full during a step are stored by the workers right after it, and
cascade to the tiers below (:meth:`~kvhal.tiers.chain.TierChain.prepare_store`): a store
is written to unless it is down or ``max_inflight_blocks`` are being written already (then
dropped, counted), a local tier unless it reads slower than recomputing. Job results come
back through the workers' metadata (counted per job in a
:class:`~kvhal.vllm.job_table.JobTable`) and end the chain's loads, stores and writes.

Stores run while later steps compute. A store's source blocks must not be rewritten before
it has read them, so: a finished request with stores in flight keeps its blocks
(``request_finished`` returns True) until every worker reports it in
``finished_sending``; and each step's metadata names the stores whose blocks vLLM may
rewrite in that step for the workers to fence (:mod:`kvhal.vllm.fences`). The host tier's
changes, and the tiers below's, reach vLLM as KV events (:mod:`kvhal.vllm.kv_events`).

What it keeps per request is a :class:`~kvhal.vllm.request_state.RequestState`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvhal.errors import ValidationError
from kvhal.offload.manager import OffloadingManager
from kvhal.offload.wait_policy import StepTimes
from kvhal.tiers.chain import LoadPlan, TierChain
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.fences import StoreFences
from kvhal.vllm.hit_sources import by_kind, split_hit
from kvhal.vllm.job_table import JobTable, Pending
from kvhal.vllm.keys import offload_keys
from kvhal.vllm.kv_events import kv_events, tier_kv_events
from kvhal.vllm.local import waits_whole
from kvhal.vllm.metadata import KVHALMetadata, KVHALWorkerMetadata, LoadJob, ReadJob, StoreJob, WriteJob
from kvhal.vllm.prefetch import Prefetcher, Started
from kvhal.vllm.request_state import RequestState
from kvhal.vllm.scheduler_stores import StorePlanner
from kvhal.vllm.stats import RECORD_ALL, KVHALStats, tier_key
from kvhal.vllm.store_lookup import lookup_stores
from kvhal.vllm.store_state import StoreStates, stats_data
from kvhal.vllm.tenants import TenantLabels
from kvhal.vllm.tier_list import SchedulerTier, open_scheduler_tiers
from kvhal.vllm.versions import STATS_NEED_REQUEST_OUTPUTS, failed_recving

if TYPE_CHECKING:
    from kvhal.vllm.worker_side import WorkerSide

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: The key of ``RequestOutput.kv_transfer_params`` that says how many prompt
#: tokens kvhal loaded for the request (0 after a failed load).
LOADED_TOKENS = "kvhal_loaded_tokens"


@dataclass
class SchedulerSide:
    """Scheduler-side state of one engine's connector.

    :param local: the engine's one worker side where it runs in this process
        (:mod:`kvhal.vllm.local`): the tiers below are read at lookup through it; ``None``:
        by the workers' jobs.
    :param kv_events: whether vLLM publishes KV events (its ``kv_events_config``): without,
        the tiers keep nothing to tell (no event lists, no local tier's slot keys).
    """

    config: ConnectorConfig
    stats: KVHALStats = field(default_factory=KVHALStats)
    local: WorkerSide | None = None
    kv_events: bool = False

    def __post_init__(self) -> None:
        self._step_times = StepTimes()  # the engine's compute rate, one for every tier's policy
        self.tiers: list[SchedulerTier] = open_scheduler_tiers(self.config, self.stats, self._step_times)
        self.stores = [tier for tier in self.tiers if tier.shared]
        self.store_states = StoreStates(tier.name for tier in self.stores)  # up, down, refused
        self.tenants = TenantLabels(self.config.tenant_labels)  # cache_salt -> a bounded label
        self._waiting = [tier for tier in self.tiers if tier.waiting]  # local tiers not joined yet
        self.manager, self.chain = self._new_chain()
        self._requests: dict[str, RequestState] = {}
        self._hold_stats = False  # keep this step's counters for the next (see take_stats)
        self._send_stats = True  # the last scheduled step's KVHALMetadata.send_stats
        self.jobs = JobTable(self.config.world_size)
        self._pending_loads: list[LoadJob] = []
        waits = {tier.name: tier.wait for tier in self.tiers}
        self.prefetcher = Prefetcher(self.config, self.stats, waits, self.jobs.read, self.local)
        self.fences = StoreFences(self.config.block_size, self.stats)  # the stores a step may overwrite
        self.planner = StorePlanner(self.config, self.stats, self.tiers, self.jobs, self.fences)
        self._last_step: tuple[float, int] | None = None  # the last step's start, its tokens
        self.arriving: set[str] = set()  # looked up at arrival, not asked by vLLM yet (kvhal.vllm.arrivals)
        self._held: list[str] = []  # finished requests to announce to the workers
        self._holding: set[str] = set()  # held requests not yet reported in finished_sending
        self._gauges_sent: dict[str, int] = {}  # each gauge's last reported value

    def _new_chain(self) -> tuple[OffloadingManager, TierChain]:
        """The host tier's manager and the chain over it and the tiers below."""
        events = self.kv_events
        manager = OffloadingManager(self.config.num_slots, self.config.eviction_policy, enable_events=events)
        return manager, TierChain(manager, [tier.chain for tier in self.tiers], events=events)

    def track(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tenant = self.tenants.label(request.cache_salt)
            state = self._requests[request.request_id] = RequestState(request, tenant=tenant)
        return state

    # -- lookups and loads -----------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` kvhal can load, block-aligned and
        short of the last prompt token (vLLM computes at least one); ``None``
        while a store that would extend the hit, a store's lookup or a prefetch is in
        flight."""
        state = self.track(request)
        self.arriving.discard(request.request_id)  # vLLM asks: it is near the front of the queue
        if state.load_failed:  # offering the same hit again would loop (the load failed)
            return 0, False
        self._join_tiers()
        if state.prefetch is not None and not state.prefetch.done:
            self.prefetcher.wait_local(state)  # a read started at its arrival (arrived)
        self.prefetcher.poll_local_reads(self.chain)
        if state.prefetch is not None:
            if not state.prefetch.done and time.monotonic() < state.prefetch.deadline:
                return None, False  # the request holds no device blocks meanwhile
            if not state.prefetch.done:  # past the wait: what is in host memory now is the hit
                for name in state.read_from:
                    self.stats.add_tier("tier_prefetch_timeouts", name, 1)
            waited = time.monotonic() - state.prefetch.started
            for name in state.read_from:
                self.stats.observe("lookup_wait_seconds", name, waited)
            state.prefetch = None
        bs = self.config.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        hashes = list(request.block_hashes[start:end])
        hit, below = self._walk(state, start, len(hashes), {})
        if hit is None:
            return None, False
        held: dict[str, set[bytes]] = {}
        if self.stores and hit < len(hashes) and not state.prefetched:
            # a store's blocks are read once, at the request's prefetch: after it, recomputed
            whole = waits_whole(self.local)
            if not lookup_stores(self.stores, self.config, self.stats, state, start, hashes, hit, whole):
                return None, False
            held = state.held
            hit, below = self._walk(state, start, len(hashes), held)
            if hit is None:
                return None, False
        if below:
            started = Started.RECOMPUTE if state.recompute_below else None
            if started is None:
                started = self.prefetcher.start(self.chain, state, start, hashes[:hit], held)
            if started is Started.READ_NOW:  # read in this lookup: the blocks are host blocks now
                return self.lookup(request, num_computed_tokens)
            if started is Started.WAITING:
                return None, False
            if started is Started.RECOMPUTE:  # the host tier's part of the hit, loaded as a host hit
                state.recompute_below = True
                hit, below = self.prefetcher.host_prefix(self.chain, hashes[:hit]), False
        state.hit_start, state.hit_blocks = start, hit
        state.hit_sync = hit > 0 and not below and self.config.sync_host_loads
        return hit * bs, hit > 0 and not state.hit_sync

    def _walk(
        self, state: RequestState, start: int, count: int, held: dict[str, set[bytes]]
    ) -> tuple[int | None, bool]:
        """``(hit, below)``: the blocks of the request's ``count`` from ``start`` the chain can
        load (every group's), and whether some are read from a tier below first; ``None`` while
        a store to the host tier would extend the hit."""
        hit, below = count, False
        for group in self.config.groups:
            if hit == 0:
                break
            keys = state.keys(group.group_id, start + hit)[start : start + hit]
            found, promoted = self.chain.lookup(keys, held)
            if found < hit and keys[found] in self.planner.storing:
                return None, False
            hit = found
            below |= promoted > 0
        return hit, below

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of a hit into the blocks vLLM just allocated (vLLM calls it for a miss
        too, with 0: its tokens were asked about all the same)."""
        state = self.track(request)
        bs = self.config.block_size
        asked = max(0, len(request.block_hashes) - state.hit_start) * bs
        self.stats.add("lookup_tokens", asked)
        if state.tenant is not None:
            self.stats.add_tenant("tenant_lookup_tokens", state.tenant, asked)
        if num_external_tokens == 0:
            return
        count = num_external_tokens // bs
        if state.hit_blocks < count:
            raise ValidationError(
                "num_external_tokens", f"{count} blocks allocated for a hit of {state.hit_blocks} blocks"
            )
        gids = [group.group_id for group in self.config.groups]
        group_ids, keys, indices = state.blocks(
            gids, blocks.get_block_ids(), state.hit_start, state.hit_start + count
        )
        for ids in group_ids.values():
            self.fences.load_blocks.update(ids)
        held = {} if state.prefetched else state.held
        plan = self.chain.prepare_load(keys, held, indices)
        state.hit_split = {}  # by the tier that served each block, where a load is planned
        if plan is None:
            # the host tier had no room left for the promotion since the lookup:
            # the job fails on the workers without copying, and vLLM recomputes
            groups = {gid: ([], []) for gid in group_ids}
        else:
            groups, at = {}, 0
            for gid, ids in group_ids.items():  # the plan's slots, in the keys' order
                groups[gid] = (ids, plan.host_slots[at : at + len(ids)])
                at += len(ids)
            self.manager.touch_slots(plan.host_slots)  # the keys' slots, in order: touch(keys)
            # the tiers' shares of the hit: read at its lookup (a prefetch), or by this load
            read_from = dict(state.read_from)
            for read in plan.reads:
                read_from.setdefault(read.tier, set()).update(read.keys)
            block_of = dict(zip(keys, indices, strict=True)) if read_from else {}
            for name, read in read_from.items():
                tokens = len({block_of[k] for k in keys if k in read}) * bs
                self.stats.add_tier("tier_hit_tokens", name, tokens)
            state.hit_split = split_hit(count, bs, block_of, read_from, [t.name for t in self.tiers])
            state.read_from = {}
        job = self.jobs.load(request.request_id, keys, groups, plan)
        job.sync, job.doomed = state.hit_sync, plan is None
        if job.sync:
            self.stats.add("sync_hit_tokens", num_external_tokens)
        self._pending_loads.append(job)
        state.loading = job.job_id
        state.loading_blocks = (state.hit_start, state.hit_start + count) if plan is not None else (0, 0)
        state.loaded_tokens = num_external_tokens
        self.stats.add("hit_tokens", num_external_tokens)
        if state.tenant is not None:
            self.stats.add_tenant("tenant_hit_tokens", state.tenant, num_external_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """``request``'s hit by the kind of tier that served it (``host``, ``local``,
        ``shared``), for vLLM's hit sources (:mod:`kvhal.vllm.hit_sources`)."""
        state = self._requests.get(request.request_id)
        split = state.hit_split if state is not None else {}
        return by_kind(split, {tier.name for tier in self.stores}, num_external_tokens)

    # -- each step -------------------------------------------------------------

    def _join_tiers(self) -> None:
        """Local tiers whose medium was another engine's join once it is this one's (polled at
        each lookup and step: a list that is empty once they joined)."""
        if self._waiting:
            for tier in self._waiting:
                tier.join(self.stats)
            self._waiting = [tier for tier in self._waiting if tier.waiting]

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVHALMetadata:
        self._join_tiers()  # before this step's stores: a tier joined now is written by them
        self.prefetcher.poll_local_reads(self.chain)  # an aborted request's read ends here
        self._time_steps(scheduler_output.total_num_scheduled_tokens)
        # fences first: this step's own stores are ordered after its compute anyway
        fence = self.fences.take(scheduler_output, self._requests)
        stores = self.planner.plan(scheduler_output, self._requests, self.chain)
        meta = KVHALMetadata(
            prefetches=self.prefetcher.take_jobs(),
            loads=self._pending_loads,
            stores=stores,
            fence=fence,
            held=self._held,
            writes=self.planner.write_backs(self.chain),  # after the stores: they snapshot evictions
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
        """The engine's compute rate for the wait policies: a step's tokens over the time to
        the next step's schedule, while the engine is busy (an idle gap is not compute)."""
        now = time.monotonic()
        waits = any(tier.wait is not None for tier in self.tiers)
        if waits and self._last_step is not None and tokens > 0:
            started, computed = self._last_step
            self._step_times.add(computed, now - started)
        self._last_step = (now, tokens) if tokens > 0 else None

    # -- results -----------------------------------------------------------------

    def on_output(self, output: KVConnectorOutput) -> None:
        self.store_states.count(stats_data(output.kv_connector_stats))  # the workers' reads
        worker_meta = output.kv_connector_worker_meta
        if isinstance(worker_meta, KVHALWorkerMetadata):
            # in job order: a store's write-through (a later job) ends after the store
            reports = [(j, n, True) for j, n in worker_meta.succeeded.items()]
            reports += [(j, n, False) for j, n in worker_meta.failed.items()]
            for job_id, count, ok in sorted(reports):
                pending = self.jobs.report(job_id, count, ok)
                if pending is not None:  # every worker reported it
                    self._ended(pending)
        self._holding.difference_update(output.finished_sending or ())
        for req_id in failed_recving(output):
            state = self._requests.get(req_id)
            if state is not None:
                state.load_failed = True
                state.loaded_tokens = 0

    def _ended(self, pending: Pending) -> None:
        """A job every worker reported: one place per kind of job."""
        job = pending.job
        # timed to the step that reports it: an upper bound, the same for each tier
        seconds = time.monotonic() - pending.started
        if isinstance(job, WriteJob):
            self.stats.observe("tier_write_seconds", job.tier, seconds)
            self.planner.write_ended(pending, self.chain)
        elif isinstance(job, StoreJob):
            self.stats.observe("tier_write_seconds", "host", seconds)
            state = self._requests.get(job.req_id)
            if state is not None:
                state.store_jobs.discard(job.job_id)
            self.planner.store_ended(pending, self.chain)
        elif isinstance(job, ReadJob):
            assert isinstance(pending.plan, LoadPlan)
            ok = {read.tier: pending.ok for read in job.reads}
            state = self._requests.get(job.req_id)
            self.prefetcher.end_read(
                self.chain, state, job.job_id, pending.plan, ok, dict.fromkeys(ok, seconds)
            )
        else:
            assert isinstance(job, LoadJob)
            self.stats.observe("device_load_seconds", job.reads[0].tier if job.reads else "host", seconds)
            self._load_ended(pending)

    def _load_ended(self, pending: Pending) -> None:
        job = pending.job
        assert isinstance(job, LoadJob)
        state = self._requests.get(job.req_id)
        if state is not None and state.loading == job.job_id:
            state.loading = None
        if isinstance(pending.plan, LoadPlan):  # None: the chain refused it, nothing to release
            self.chain.complete_load(pending.plan, success=pending.ok)
            for read in pending.plan.reads:
                if pending.ok:
                    self.stats.add_tier("tier_loaded_blocks", read.tier, len(read.keys))
                else:
                    self.stats.add_tier("tier_failed_loads", read.tier, 1)
                    if state is not None:
                        state.forget_read(read.tier, read.keys)
        if not pending.ok:
            self.stats.add("failed_loads", 1)
            # its request may be this step's only one, and skipped: no request outputs
            self._hold_stats = STATS_NEED_REQUEST_OUTPUTS
            if state is not None:  # a synchronous load's request learns it here
                state.load_failed = True
                state.loaded_tokens = 0
        elif pending.keys:
            self.stats.add("loaded_blocks", len(pending.keys))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Mark the request's prompt blocks used (the eviction policy's recency).

        Returns True (vLLM keeps the request's blocks) while stores reading them
        are in flight; the workers then report the request in ``finished_sending``
        once those stores finished, failed ones included. A request whose load is
        in flight has no such store (it has not run since its blocks were
        allocated), and vLLM frees its blocks when the load is reported.
        """
        state = self._requests.pop(request.request_id, None)
        self.arriving.discard(request.request_id)
        full = min(len(request.block_hashes), request.num_prompt_tokens // self.config.block_size)
        # block by block, every group's key: the manager makes the first key the most
        # recent, so a shared prefix outlives the tails behind it
        groups = self.config.groups
        if state is None:
            per_group = [offload_keys(request.block_hashes[:full], g.group_id) for g in groups]
        else:
            per_group = [state.keys(g.group_id, full)[:full] for g in groups]
        self.manager.touch(
            per_group[0] if len(per_group) == 1 else [k for ks in zip(*per_group, strict=True) for k in ks]
        )
        hold = state is not None and bool(state.store_jobs) and state.loading is None
        if hold:
            self._held.append(request.request_id)
            self._holding.add(request.request_id)
            self.stats.add("held_requests", 1)
        return hold, {LOADED_TOKENS: state.loaded_tokens if state else 0}

    def take_events(self) -> list[KVCacheEvent]:
        """What every tier stored and evicted since the last call, as vLLM's KV events."""
        bs, stores = self.config.block_size, [tier.name for tier in self.stores]
        return kv_events(self.manager.take_events(), bs) + tier_kv_events(
            self.chain.take_tier_events(), stores, bs
        )

    def take_stats(self) -> KVHALStats | None:
        """This step's counters for vLLM, or None to carry them into the next step: where vLLM
        drops the stats of a step without request outputs, only a step in which a request
        samples a token sends them, and not one whose load failed (its request is skipped)."""
        if STATS_NEED_REQUEST_OUTPUTS:
            hold = self._hold_stats or not self._send_stats
            self._hold_stats = False
            if hold:
                return None
        if RECORD_ALL:
            self._gauges()
        return self.stats.take()

    def _gauges(self) -> None:
        """Occupancy and health now, set where changed since the last report (the scheduler
        side alone reports gauges: once, whatever the workers)."""
        manager, slot = self.manager, self.config.slot_bytes
        used = len(manager)
        now = {"host_used_slots": used, "host_slots": manager.num_slots}
        now["host_pinned_slots"] = used - manager.num_storing - manager.num_evictable
        inflight = dict.fromkeys(["host", *(tier.name for tier in self.tiers)], 0)
        for pending in self.jobs.pending():  # a job's blocks, not per block: a few jobs a step
            job = pending.job
            if isinstance(job, WriteJob):
                inflight[job.tier] += len(job.keys)
                continue
            if not isinstance(job, ReadJob):
                inflight["host"] += len(pending.keys)
            for read in getattr(job, "reads", ()):
                inflight[read.tier] += len(read.keys)
        for name, blocks in inflight.items():
            now[tier_key("tier_inflight_bytes", name)] = blocks * slot
        for tier in self.tiers:
            index = tier.chain.index
            if index is not None:
                now[tier_key("tier_used_bytes", tier.name)] = len(index) * slot
                now[tier_key("tier_budget_bytes", tier.name)] = index.num_slots * slot
            up = tier.up  # a local tier: 0 while its medium is another engine's (not joined)
            if up is not None:
                now[tier_key("tier_up", tier.name)] = int(up)
        now.update(self.store_states.gauges(self.stores, self.stats.data))  # its own reads too
        for key, value in now.items():
            if self._gauges_sent.get(key) != value:
                self.stats.set_gauge(key, value)
                self._gauges_sent[key] = value

    def has_jobs_in_flight(self) -> bool:
        self.prefetcher.poll_local_reads(self.chain)
        return bool(self.jobs or self.prefetcher.local_reads)

    def has_held_blocks(self) -> bool:
        """Whether finished requests' blocks will be freed once their stores finish."""
        return bool(self._holding)

    def reset(self) -> bool:
        """Forget everything the host tier and the local tiers hold; refused (False) while
        jobs are in flight."""
        if self.has_jobs_in_flight():
            return False
        for tier in self.tiers:
            tier.reset()
        self.manager, self.chain = self._new_chain()
        for state in self._requests.values():
            state.stored_upto = 0
        return True

    def close(self) -> None:
        """Release the local tiers' media (another engine may open them then), and the stores."""
        for tier in self.tiers:
            tier.close()
