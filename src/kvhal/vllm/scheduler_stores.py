"""The scheduler side's stores: the blocks a step fills, stored to the host tier and cascaded
to the tiers below, and how each store and write ends.

Each step, the blocks that became full are stored (:meth:`StorePlanner.plan`): a
:class:`~kvhal.vllm.metadata.StoreJob` copies them into host slots, and its write-throughs
(:class:`~kvhal.vllm.metadata.WriteJob`, one per tier) run once its copy is done, on the
workers, without a round trip here. Which tiers a store writes to:

- a local tier, unless its wait policy says it reads slower than recomputing (a tier not
  worth reading is not worth writing), or it has not joined yet (its medium is still another
  engine's: :meth:`~kvhal.vllm.tier_list.SchedulerTier.join`);
- a store the fleet shares, unless it is down or ``max_inflight_blocks`` are being written
  to it already (the blocks are dropped, counted), and never the blocks this request read
  from that store (they are there).

Write-back snapshots of what the host tier evicted go out after the stores
(:meth:`StorePlanner.write_backs`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from itertools import chain as chain_lists

from vllm.v1.core.sched.output import SchedulerOutput

from kvhal.tiers.chain import TierChain, WritePlan
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.fences import StoreFences
from kvhal.vllm.job_table import JobTable, Pending
from kvhal.vllm.metadata import Groups, StoreJob, WriteJob
from kvhal.vllm.request_state import RequestState
from kvhal.vllm.stats import KVHALStats
from kvhal.vllm.tier_list import SchedulerTier
from kvhal.vllm.versions import BlockTables


@dataclass
class _Quarantine:
    """A failed store's host slots, kept taken until every rank reported its writes."""

    keys: list[bytes]
    writes: set[int]


class StorePlanner:
    """Plans one scheduler side's stores and writes, and ends them."""

    def __init__(
        self,
        config: ConnectorConfig,
        stats: KVHALStats,
        tiers: Sequence[SchedulerTier],
        jobs: JobTable,
        fences: StoreFences,
    ) -> None:
        self.config, self.stats, self.jobs, self.fences = config, stats, jobs, fences
        self.tiers = {tier.name: tier for tier in tiers}
        self.storing: set[bytes] = set()  # keys being stored to the host tier
        self._block_tables = BlockTables()  # device blocks per request (vLLM 0.32 hands its own)
        self._quarantined: dict[int, _Quarantine] = {}  # write job id -> the failed store it reads

    def plan(
        self, scheduler_output: SchedulerOutput, requests: dict[str, RequestState], chain: TierChain
    ) -> list[StoreJob]:
        """The stores of the blocks this step fills, each with its write-throughs."""
        bs = self.config.block_size
        block_state = self._block_tables.update(scheduler_output)
        stores: list[StoreJob] = []
        gids = [group.group_id for group in self.config.groups]
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = requests.get(req_id)
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
            first, held = state.stored_upto, 0
            lo, hi = state.loading_blocks if state.loading is not None else (0, 0)
            if lo <= first < hi:
                # blocks a load in flight holds in the host tier: the host tier would skip them
                # one by one (present), so they are left out here, only counted
                held = sum(len(ids) - ids.count(0) for ids in (table[g][first : min(hi, end)] for g in gids))
                first = min(hi, end)
            ids_of, keys, indices = state.blocks(gids, table, first, end)
            block_of = list(chain_lists.from_iterable(ids_of.values()))  # each key's device block
            starts = list(accumulate((len(ids) for ids in ids_of.values()), initial=0))  # its group's
            where = dict(zip(keys, range(len(keys)), strict=True))  # a key twice: its last block
            state.stored_upto = end
            planned = chain.prepare_store(list(where), self._writable(held + len(where)))
            if planned is None:
                self.stats.add("store_skipped_blocks", held + len(where))
                continue
            plan, writes = planned
            self.stats.add("evicted_blocks", len(plan.evicted))
            if not plan.keys:
                continue
            groups: Groups = {}
            if len(gids) == 1:  # one KV cache group (most models): no group to find a key
                groups[gids[0]] = ([block_of[where[key]] for key in plan.keys], list(plan.slots))
            else:
                for key, slot in zip(plan.keys, plan.slots, strict=True):
                    at = where[key]
                    group_id, block_id = gids[bisect_right(starts, at) - 1], block_of[at]
                    ids, slots = groups.setdefault(group_id, ([], []))
                    ids.append(block_id)
                    slots.append(slot)
            self.storing.update(plan.keys)
            job = self.jobs.store(req_id, plan.keys, groups, state.tenant)
            self.fences.add(job.job_id, self.jobs[job.job_id].blocks)
            position = dict(zip(keys, indices, strict=True))
            for write in writes:
                write = self._admitted(write, state, position)
                if write is not None:
                    job.writes.append(self.jobs.write(write))
            state.store_jobs.add(job.job_id)
            stores.append(job)
        return stores

    def _writable(self, blocks: int) -> list[str]:
        """The tiers a store of ``blocks`` may write to now (see the module docstring)."""
        names = []
        for tier in self.tiers.values():
            if not tier.chain.ready:  # a local tier whose medium is not this engine's yet
                continue
            if tier.shared or tier.wait is None or not tier.wait.slow:
                names.append(tier.name)
            else:
                self.stats.add_tier("tier_slow_skipped_writes", tier.name, blocks)
        return names

    def _admitted(
        self, write: WritePlan, state: RequestState, position: dict[bytes, int]
    ) -> WritePlan | None:
        """``write`` as a store takes it: without the blocks this request read from it, with
        each block's position in the request (``position``), and within its in-flight limit
        (else dropped, counted); ``None``: nothing to write."""
        tier = self.tiers[write.tier]
        if not tier.shared:
            return write
        there = state.held.get(write.tier, set()) | state.read_from.get(write.tier, set())
        keep = [i for i, key in enumerate(write.keys) if key not in there]
        if not keep:
            return None
        keys = [write.keys[i] for i in keep]
        write = WritePlan(
            write.tier,
            keys,
            [write.host_slots[i] for i in keep],
            [],
            False,
            positions=[position[k] for k in keys],
        )
        if not tier.admit_write(len(write.keys)):
            self.stats.add_tier("tier_dropped_blocks", tier.name, len(write.keys))
            return None
        return write

    def write_backs(self, chain: TierChain) -> list[WriteJob]:
        """Write-back snapshots of the blocks this step's stores and promotions evicted."""
        writes = [self.jobs.write(plan) for plan in chain.take_writes()]
        for tier in chain.local:
            self.stats.add_tier("tier_write_skipped_blocks", tier.name, tier.skipped_writes)
            self.stats.add_tier("tier_evicted_blocks", tier.name, tier.evictions)
            tier.skipped_writes = tier.evictions = 0
        return writes

    def store_ended(self, pending: Pending, chain: TierChain) -> None:
        """Every worker reported the store ``pending``: its blocks are host blocks (or not)."""
        job = pending.job
        assert isinstance(job, StoreJob)
        self.fences.remove(job.job_id, pending.blocks)
        self.storing.difference_update(pending.keys)
        writes = [self.jobs[w.job_id] for w in job.writes if w.job_id in self.jobs]
        if not pending.ok and writes and self.config.world_size > 1:
            # A rank whose own share stored is writing it below from these host slots:
            # freed now, a new store could overwrite them mid-write (wrong KV below).
            quarantine = _Quarantine(pending.keys, {w.job.job_id for w in writes})
            self._quarantined.update(dict.fromkeys(quarantine.writes, quarantine))
        else:
            plans = [w.plan for w in writes if isinstance(w.plan, WritePlan)]
            chain.complete_store(pending.keys, success=pending.ok, writes=plans)
        if not pending.ok:
            self.stats.add("failed_stores", 1)
        elif pending.keys:  # once per block, however many workers copied a share of it
            self.stats.add("stored_blocks", len(pending.keys))
            if pending.tenant is not None:  # every worker's share: as the workers' stored_bytes
                shares = len(pending.keys) * self.config.slot_bytes * self.config.world_size
                self.stats.add_tenant("tenant_stored_bytes", pending.tenant, shares)

    def write_ended(self, pending: Pending, chain: TierChain) -> None:
        """Every worker reported the write ``pending``: its blocks are in its tier (or not)."""
        job, plan = pending.job, pending.plan
        assert isinstance(job, WriteJob) and isinstance(plan, WritePlan)
        chain.complete_write(plan, success=pending.ok)
        tier = self.tiers[job.tier]
        if tier.shared:
            tier.writing -= len(pending.keys)
        if pending.ok:
            self.stats.add_tier("tier_written_blocks", job.tier, len(pending.keys))
        else:
            self.stats.add_tier("tier_failed_writes", job.tier, 1)
        quarantine = self._quarantined.pop(job.job_id, None)
        if quarantine is not None:
            quarantine.writes.discard(job.job_id)
            if not quarantine.writes:  # every rank's writes from the slots ended
                chain.complete_store(quarantine.keys, success=False)
