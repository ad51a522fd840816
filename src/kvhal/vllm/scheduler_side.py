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
it. Job results come back through the workers'
metadata and complete the manager's loads and stores.

Stores run while later steps compute. A store's source blocks must not be
rewritten before it has read them, so: a finished request with stores in
flight keeps its blocks (``request_finished`` returns True) until every
worker reports it in ``finished_sending``; and each step's metadata names the
stores whose blocks vLLM may rewrite in that step (the request was preempted,
or a block was allocated again, as sliding-window blocks are while their
request runs) for the workers to fence. No other store delays a step.

With a tier below host memory (``disk_path``, or a plugin's backend), a
:class:`~kvhal.tiers.chain.TierChain` holds both tiers' indexes: a hit found
below is prefetched at lookup (read into host slots while vLLM is answered
``None``; by the lookup itself, waiting up to :data:`LOCAL_READ_WAIT_S`, where
the one worker shares this process), then loaded as a host hit; without a
prefetch the load job itself reads, then copies. Stores cascade into the lower
tier as write jobs the workers run off the engine's thread.

With a remote tier shared by a fleet (``remote_url``), a lookup that the
local tiers end short asks the store whether it holds the following blocks;
the request is asked again (``None``) until the answer comes or
``remote_lookup_timeout_ms`` passes (a miss). Blocks the store holds are
prefetched as the lower tier's are (with their own wait policy, deadline
``remote_load_timeout_ms``), then loaded as a host hit; where no prefetch is
made (budget, room) the load job reads them, then copies. Every block stored to the
host tier is written to the store too, unless ``remote_max_inflight_blocks``
are being written already or the store is down: then it is dropped, counted.
"""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvhal.errors import ValidationError
from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.offload.wait_policy import PROBE, StepTimes, WaitPolicy
from kvhal.tiers.backend import OK, TierBackend
from kvhal.tiers.chain import LoadPlan, TierChain, WritePlan
from kvhal.tiers.index import TierIndex
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm import local
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key, split_offload_key
from kvhal.vllm.lower_tier import open_lower_tier
from kvhal.vllm.metadata import (
    JobKind,
    KVHALMetadata,
    KVHALWorkerMetadata,
    TierReads,
    TierWrite,
    TransferJob,
)
from kvhal.vllm.remote import open_remote_tier
from kvhal.vllm.stats import REMOTE_READ_COUNTERS, TIER_READ_COUNTERS, KVHALStats
from kvhal.vllm.versions import STATS_NEED_REQUEST_OUTPUTS, BlockTables, failed_recving

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level

#: How long a lookup waits for a read of the in-process worker's tier: a returning user's
#: blocks (about 10 MiB) take a few milliseconds from a disk of 2.7 GB/s, an engine step of
#: the others' decode about 65 ms (the CPU benchmarks); a read not done by then is waited
#: for as a prefetch (``None`` answers) until ``lower_tier_wait_ms``.
LOCAL_READ_WAIT_S = 0.02
#: How long a lookup waits for the store to say whether it holds a request's blocks: a
#: round trip of a millisecond or less, where answering ``None`` costs the request a step.
REMOTE_LOOKUP_WAIT_S = 0.005
#: Steps after its read ends that the scheduler side learns of a workers' prefetch: it
#: starts at the next step, and ends in that step's output or the one after.
WORKER_READ_STEPS = 2
#: :meth:`SchedulerSide._start_prefetch`'s answer for a read made and ended in the lookup.
READ_NOW = object()
#: :meth:`SchedulerSide._start_prefetch`'s answer when reading would be slower than recomputing.
RECOMPUTE = object()
#: What a prefetch counts, per tier it reads: (the lower tier's counter, the remote tier's).
PREFETCH_COUNTERS = {
    "prefetched": ("prefetched_blocks", "remote_prefetched_blocks"),
    "timeouts": ("prefetch_timeouts", "remote_prefetch_timeouts"),
    "skipped": ("prefetch_skipped_blocks", "remote_prefetch_skipped_blocks"),
    "probes": ("prefetch_probes", "remote_probes"),
    "slow": ("prefetch_slow_tier_blocks", "remote_slow_blocks"),
    "loaded": ("tier_loaded_blocks", "remote_loaded_blocks"),
    "failed": ("tier_failed_loads", "remote_failed_loads"),
    "read_bytes": ("tier_read_bytes", "remote_read_bytes"),
}
#: The medium kvhal's host tier appears as in vLLM's KV events.
MEDIUM = "CPU"
#: The key of ``RequestOutput.kv_transfer_params`` that says how many prompt
#: tokens kvhal loaded for the request (0 after a failed load).
LOADED_TOKENS = "kvhal_loaded_tokens"


def _log_recovery(done: int, total: int) -> None:
    """Progress of a warm restart's index rebuild (the backend calls it now and then)."""
    logger.info("kvhal: recovering the lower tier's index: %d of %d slots read", done, total)


@dataclass
class _Probe:
    """A remote lookup of a request's blocks ``[first, first + len(hashes))``."""

    first: int
    hashes: list[bytes]
    future: Future[list[bool]]
    deadline: float
    blocks: int | None = None  # the answer: how many of them the store holds, from the first


@dataclass
class _Prefetch:
    """Blocks of a request being read from a tier below into host slots at its lookup."""

    job_id: int  # the workers' job, or -1 for a read of the in-process worker's tier (``local``)
    deadline: float
    done: bool = False
    started: float = 0.0
    remote: bool = False  # read from the remote tier (else the lower tier)


@dataclass
class _LocalRead:
    """A read the scheduler side made through the in-process worker's tier (``local``)."""

    plan: LoadPlan
    future: Future[list[str | None]]
    state: _RequestState
    started: float
    ended: float | None = None  # set by the future's callback, on the reading thread
    remote: bool = False  # a read of the remote tier (else the lower tier)

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._end)

    def _end(self, _: Future[list[str | None]]) -> None:
        self.ended = time.monotonic()


@dataclass
class _RequestState:
    request: Request
    stored_upto: int = 0  # blocks [0, stored_upto) were considered for storing
    hit_start: int = 0  # the last lookup's hit, in blocks
    hit_blocks: int = 0
    hit_sync: bool = False  # the last lookup's hit is loaded in the step that schedules it
    loaded_tokens: int = 0
    load_failed: bool = False
    loading: int | None = None  # the load job in flight, if any
    # store jobs in flight that read the blocks the request holds now
    store_jobs: set[int] = field(default_factory=set)
    probe: _Probe | None = None  # the last remote lookup
    fetch: set[bytes] = field(default_factory=set)  # keys the remote tier holds, per the probe
    prefetch: _Prefetch | None = None  # the read from the lower tier it waits for, if any
    prefetched: bool = False  # one prefetch per request: a hit lost again loads as before
    remote_prefetched: bool = False  # one from the remote tier too: what it missed is recomputed
    recompute_below: bool = False  # the wait policy chose to recompute what is below the host tier
    from_below: set[bytes] = field(default_factory=set)  # keys its prefetch read from below
    from_store: set[bytes] = field(default_factory=set)  # keys its prefetch read from the store


@dataclass
class _Job:
    kind: JobKind
    req_id: str
    keys: list[bytes]
    blocks: frozenset[int] = frozenset()  # a store's source block ids, every group's
    reports: int = 0
    ok: bool = True
    plan: LoadPlan | WritePlan | None = None  # a load's or a write's plan in the tier chain
    remote: WritePlan | None = None  # a store's write-through to the remote tier
    prefetch: bool = False  # a load that only reads the lower tier into host slots
    started: float = 0.0  # a prefetch's start (its read's time, to the step that reports it)
    writes: list[int] = field(default_factory=list)  # a store's write jobs (lower, remote)


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
        if self.config.remote_tier is not None:
            self.remote = open_remote_tier(self.config, role="index", rank=0, stats=self.stats)
        self._remote_writing = 0  # blocks being written to the remote tier
        self.manager, self.chain = self._new_chain()
        self._requests: dict[str, _RequestState] = {}
        self._block_tables = BlockTables()  # device blocks per request (vLLM 0.32 hands its own)
        self._hold_stats = False  # keep this step's counters for the next (see take_stats)
        self._send_stats = True  # the last scheduled step's KVHALMetadata.send_stats
        self._jobs: dict[int, _Job] = {}
        self._storing: set[bytes] = set()
        self._pending_loads: list[TransferJob] = []
        self._pending_prefetches: list[TransferJob] = []
        self._prefetching = 0  # blocks being read by prefetches
        self._local_reads: list[_LocalRead] = []
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
        self._last_step: tuple[float, int] | None = None  # the last step's start, its tokens
        self._next_job = 0
        # block id -> store jobs in flight reading it (ids are shared by every
        # group's layers in vLLM's one block pool, so groups are not told apart)
        self._readers: dict[int, set[int]] = {}
        self._load_blocks: set[int] = set()  # blocks this step's loads write
        self._quarantined: dict[int, _Quarantine] = {}  # write job id -> the failed store it reads
        self._held: list[str] = []  # finished requests to announce to the workers
        self._holding: set[str] = set()  # held requests not yet reported in finished_sending

    # -- lookups and loads -----------------------------------------------------

    def track(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
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
                self.stats.add("tier_recovered_blocks", index.recover(slots, keys))
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
        self._poll_local_reads()
        if state.prefetch is not None:
            if not state.prefetch.done and time.monotonic() < state.prefetch.deadline:
                return None, False  # the request holds no device blocks meanwhile
            if not state.prefetch.done:  # past the wait: what is in host memory now is the hit
                self.stats.add(PREFETCH_COUNTERS["timeouts"][state.prefetch.remote], 1)
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
            started = RECOMPUTE if state.recompute_below else self._start_prefetch(state, hashes[:hit])
            if started is READ_NOW:  # read in this lookup: the blocks are host blocks now
                return self.lookup(request, num_computed_tokens)
            if started is RECOMPUTE:  # the host tier's part of the hit, loaded as a host hit
                state.recompute_below = True
                hit, below = self._host_prefix(hashes[:hit]), False
            elif started:
                return None, False
        if self.remote is not None and hit < len(hashes):
            more = self._remote_lookup(state, start, hashes, hit)
            if more is None:
                return None, False
            if more and not below and state.remote_prefetched:
                more = 0  # its prefetch brought what it could into host memory: recompute the rest
            elif more and not below:
                started = self._start_prefetch(state, hashes[: hit + more], remote=True)
                if started is READ_NOW:
                    return self.lookup(request, num_computed_tokens)
                if started is RECOMPUTE:
                    more = 0
                elif started:
                    return None, False
            hit += more
            below |= more > 0
        state.hit_start, state.hit_blocks = start, hit
        state.hit_sync = hit > 0 and not below and self.config.sync_host_loads
        return hit * bs, hit > 0 and not state.hit_sync

    def _start_prefetch(
        self, state: _RequestState, hashes: list[bytes], remote: bool = False
    ) -> bool | object:
        """Read the blocks of ``hashes`` that only a tier below holds (the lower tier, or the
        remote tier's blocks in ``state.fetch`` if ``remote``) into host slots now, for the
        request to wait for (``None`` answers) and then load as a host hit. False (the hit
        loads asynchronously, reading then copying) when the prefetch is off, over its
        budget, was tried for this request already, or the host tier has no room.
        :data:`READ_NOW` when the read was made and ended in this call (the in-process
        worker's tier, :mod:`kvhal.vllm.local`). :data:`RECOMPUTE` when the wait policy says
        the tier is slower than recomputing, or reads it only to measure it (a probe, which
        no request waits for)."""
        policy = self.remote_wait if remote else self.wait_policy
        if policy is None or (state.remote_prefetched if remote else state.prefetched):
            return False
        # The hit's host blocks are pinned with it (as a load's are), or the promotion's new
        # slots could evict them, the oldest, and the hit would be lost again.
        keys = [offload_key(h, g.group_id) for h in hashes for g in self.config.groups]
        below = [key for key in keys if self.manager.state(key) is not BlockState.READY]
        lower = self.chain.lower
        if remote and lower is not None and any(lower.state(k) is BlockState.READY for k in below):
            return False  # the lower tier holds some too: one load reads both, as before
        host = self._host_prefix(hashes)
        worker = local.find(self.config.engine_id) if self.config.world_size == 1 else None
        reader = None if worker is None else worker.remote if remote else worker.tier_io
        wait = policy.wait_for(
            (len(hashes) - host) * self.config.block_size,
            len(below) * self.config.slot_bytes,
            steps_to_see=0 if reader is not None else WORKER_READ_STEPS,
        )
        if wait is None:  # the tier reads slower than the engine computes
            self.stats.add(PREFETCH_COUNTERS["slow"][remote], len(below))
            return RECOMPUTE
        probe = wait == PROBE
        plan = None
        if self._prefetching + len(below) <= self._prefetch_budget():
            plan = self.chain.prepare_load(keys, fetch=state.fetch if remote else ())
        if plan is None:  # over the budget, or no room in the host tier
            self.stats.add(PREFETCH_COUNTERS["skipped"][remote], len(below))
            return RECOMPUTE if probe else False  # a tier of unknown speed is not waited for
        read = plan.fetched if remote else plan.promoted
        self._prefetching += len(read)
        if remote:
            state.remote_prefetched, state.from_store = True, set(read)
        else:
            state.prefetched, state.from_below = True, set(read)
        self.stats.add(PREFETCH_COUNTERS["prefetched"][remote], len(read))
        now = time.monotonic()
        deadline = now + wait
        if reader is not None:  # the worker is in this process: read now, wait a little
            if remote:
                future = reader.read(plan.fetched, plan.fetched_host_slots)
            else:
                future = reader.read(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
            local_read = _LocalRead(plan, future, state, now, remote=remote)
            self._local_reads.append(local_read)
            futures.wait([future], timeout=0.0 if probe else min(wait, LOCAL_READ_WAIT_S))
            self._poll_local_reads()
            if future.done():
                return READ_NOW
            if probe:  # it goes on, measured, waited for by no one
                self.stats.add(PREFETCH_COUNTERS["probes"][remote], 1)
                return RECOMPUTE
            state.prefetch = _Prefetch(-1, deadline, started=now, remote=remote)
            return True
        job = self._new_job(JobKind.LOAD, state.request.request_id, read, {}, plan=plan)
        if remote:
            job.remote_reads = TierReads(plan.fetched, [], plan.fetched_host_slots)
        else:
            job.reads = TierReads(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
        job.prefetch = self._jobs[job.job_id].prefetch = True
        self._jobs[job.job_id].started = now
        self._pending_prefetches.append(job)
        if probe:
            self.stats.add(PREFETCH_COUNTERS["probes"][remote], 1)
            return RECOMPUTE
        state.prefetch = _Prefetch(job.job_id, deadline, started=now, remote=remote)
        return True

    def _prefetch_budget(self) -> int:
        """Blocks prefetches may read at once, from every tier below together."""
        lower = self.config.lower_tier
        return (lower.prefetch_blocks if lower is not None else None) or max(1, self.config.num_slots // 2)

    def _host_prefix(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, the host tier holds ready (every group's)."""
        for i, block_hash in enumerate(hashes):
            if any(
                self.manager.state(offload_key(block_hash, g.group_id)) is not BlockState.READY
                for g in self.config.groups
            ):
                return i
        return len(hashes)

    def _poll_local_reads(self) -> None:
        """End the reads made through the in-process worker's tier that finished."""
        for read in [r for r in self._local_reads if r.future.done()]:
            self._local_reads.remove(read)
            keys = read.plan.fetched if read.remote else read.plan.promoted
            try:
                outcomes = read.future.result()
            except Exception:
                logger.exception("kvhal: a read of the %s tier raised", "remote" if read.remote else "lower")
                outcomes = ["io_error"] * len(keys)
            counters = REMOTE_READ_COUNTERS if read.remote else TIER_READ_COUNTERS
            failed = [outcome for outcome in outcomes if outcome is not OK]
            for outcome in failed:
                self.stats.add(counters.get(outcome, counters["io_error"]), 1)
            good = len(outcomes) - len(failed)
            self.stats.add(PREFETCH_COUNTERS["read_bytes"][read.remote], good * self.config.slot_bytes)
            seconds = None if read.ended is None else read.ended - read.started
            self._end_prefetch(read.plan, not failed, seconds)
            waiting = read.state.prefetch  # this read's, not a later one from the other tier
            if waiting is not None and waiting.job_id == -1 and waiting.remote == read.remote:
                waiting.done = True

    def _end_prefetch(self, plan: LoadPlan, ok: bool, seconds: float | None) -> None:
        """A prefetch's read ended (``seconds`` after it started, if known): its blocks are
        host blocks now, or forgotten (a failed read may have found them corrupt)."""
        remote = bool(plan.fetched)
        keys = plan.fetched if remote else plan.promoted
        self._prefetching -= len(keys)
        self.chain.complete_load(plan, success=ok)
        if not ok:
            self.stats.add(PREFETCH_COUNTERS["failed"][remote], 1)
            return
        self.stats.add(PREFETCH_COUNTERS["loaded"][remote], len(keys))
        policy = self.remote_wait if remote else self.wait_policy
        if policy is not None and seconds is not None:
            policy.observe_read(len(keys) * self.config.slot_bytes, seconds)

    def _remote_lookup(self, state: _RequestState, start: int, hashes: list[bytes], hit: int) -> int | None:
        """How many blocks after the local hit the remote tier holds (for every group),
        within the host tier's room; ``None`` while the store has not answered."""
        assert self.remote is not None and self.config.remote_tier is not None
        groups = [g.group_id for g in self.config.groups]
        first, wanted = start + hit, hashes[hit:]
        probe = state.probe
        # The last probe answers for a later first block too (a prefetch from the store
        # made its blocks host blocks): no second round trip, no step lost to it.
        offset = first - probe.first if probe is not None else -1
        if (
            probe is None
            or offset < 0
            or (offset > 0 and probe.blocks is None)
            or probe.hashes[offset : offset + len(wanted)] != wanted
        ):
            keys = [offload_key(h, g) for h in wanted for g in groups]
            timeout = self.config.remote_tier.lookup_timeout_ms / 1000
            probe = state.probe = _Probe(first, wanted, self.remote.exist(keys), time.monotonic() + timeout)
            self.stats.add("remote_lookups", 1)
            offset = 0
            futures.wait([probe.future], timeout=REMOTE_LOOKUP_WAIT_S)
        if probe.blocks is None:
            if not probe.future.done():
                if time.monotonic() < probe.deadline:
                    return None
                probe.blocks = 0
                self.stats.add("remote_lookup_timeouts", 1)
            elif probe.future.exception() is not None:
                probe.blocks = 0
                self.stats.add("remote_lookup_errors", 1)
            else:
                found = probe.future.result()
                n = len(groups)
                held = [all(found[i * n : (i + 1) * n]) for i in range(len(probe.hashes))]
                probe.blocks = held.index(False) if False in held else len(held)
        blocks = max(0, min(probe.blocks - offset, len(wanted)))
        for i, block_hash in enumerate(wanted[:blocks]):
            # a block still being stored to the host tier is neither loadable nor fetchable yet
            if any(self.manager.state(offload_key(block_hash, g)) is BlockState.STORING for g in groups):
                blocks = i
                break
        if blocks:
            local = [offload_key(h, g) for h in hashes[:hit] for g in groups]
            blocks = min(blocks, self.chain.room(local) // len(groups))
        state.fetch = {offload_key(h, g) for h in wanted[:blocks] for g in groups}
        return blocks

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
            self._load_blocks.update(ids)
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
            prefetches = (("tier_hit_tokens", state.from_below), ("remote_hit_tokens", state.from_store))
            for counter, read in prefetches:
                prefetched = {block_of[k] for k in keys if k in read}
                if prefetched:  # a hit from a tier below, read into host memory at its lookup
                    self.stats.add(counter, len(prefetched) * bs)
            state.from_below, state.from_store = set(), set()
            if plan.promoted:
                reads = TierReads(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
                self.stats.add("tier_hit_tokens", len({block_of[k] for k in plan.promoted}) * bs)
            if plan.fetched:
                remote_reads = TierReads(plan.fetched, [], plan.fetched_host_slots)
                self.stats.add("remote_hit_tokens", len({block_of[k] for k in plan.fetched}) * bs)
        job = self._new_job(JobKind.LOAD, request.request_id, keys, groups, plan=plan)
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

    def _new_job(
        self,
        kind: JobKind,
        req_id: str,
        keys: list[bytes],
        groups: dict[int, tuple[list[int], list[int]]],
        plan: LoadPlan | WritePlan | None = None,
    ) -> TransferJob:
        job_id = self._next_job
        self._next_job += 1
        blocks = frozenset()
        if kind is JobKind.STORE:
            blocks = frozenset(b for ids, _ in groups.values() for b in ids)
            for block in blocks:
                self._readers.setdefault(block, set()).add(job_id)
        self._jobs[job_id] = _Job(kind, req_id, keys, blocks, plan=plan)
        return TransferJob(job_id, kind, req_id, groups)

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
                self.stats.add("tier_slow_skipped_writes", len(planned[0].keys))
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
            job = self._new_job(JobKind.STORE, req_id, plan.keys, groups, plan=write)
            if write is not None:
                job.write = self._write_job(write)
                self._jobs[job.job_id].writes.append(job.write.job_id)
            if self.remote is not None:
                # a block loaded from the remote tier is there already
                remote = self.chain.remote_write(plan, [k for k in plan.keys if k not in state.fetch])
                if remote is not None and self._admit_remote_write(len(remote.keys)):
                    self._jobs[job.job_id].remote = remote
                    job.remote_write = self._write_job(remote)
                    self._jobs[job.job_id].writes.append(job.remote_write.job_id)
            state.store_jobs.add(job.job_id)
            stores.append(job)
        return stores

    def _allocated_blocks(self, scheduler_output: SchedulerOutput) -> set[int]:
        """Blocks vLLM handed out this step: the ones this step may write."""
        bs = self.config.block_size
        blocks = set(self._load_blocks)
        for new in scheduler_output.scheduled_new_reqs:
            first = new.num_computed_tokens // bs  # before it: prefix-cache hits, only read
            for ids in new.block_ids:
                blocks.update(ids[first:])
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group_ids in ids or ():  # appended blocks, or a resumed request's whole table
                blocks.update(group_ids)
        for copy in scheduler_output.kv_cache_block_copies or ():
            blocks.add(copy.dst_block_id)
        blocks.update(scheduler_output.new_block_ids_to_zero or ())
        blocks.discard(0)  # the null block is never written
        return blocks

    def _fence(self, scheduler_output: SchedulerOutput) -> list[int]:
        """Store jobs in flight whose source blocks this step may rewrite."""
        jobs: set[int] = set()
        if self._readers:
            for block in self._allocated_blocks(scheduler_output):
                jobs.update(self._readers.get(block, ()))
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._requests.get(req_id)
            if state is not None:
                # vLLM freed its blocks; once fenced, those stores no longer
                # hold back the request's end (its new blocks are other ones)
                jobs.update(state.store_jobs)
                state.store_jobs.clear()
        self.stats.add("fenced_stores", len(jobs))
        return sorted(jobs)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVHALMetadata:
        self._poll_local_reads()  # an aborted request's read ends here
        self._time_steps(scheduler_output.total_num_scheduled_tokens)
        # fences first: this step's own stores are ordered after its compute anyway
        fence = self._fence(scheduler_output)
        stores = self._plan_stores(scheduler_output)
        meta = KVHALMetadata(
            prefetches=self._pending_prefetches,
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
        self._pending_loads, self._held, self._pending_prefetches = [], [], []
        self._load_blocks = set()
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

    def _admit_remote_write(self, blocks: int) -> bool:
        """Whether ``blocks`` more may be written to the remote tier now (else dropped, counted)."""
        assert self.remote is not None and self.config.remote_tier is not None
        if not self.remote.up or self._remote_writing + blocks > self.config.remote_tier.max_inflight_blocks:
            self.stats.add("remote_dropped_blocks", blocks)
            return False
        self._remote_writing += blocks
        return True

    def _write_job(self, plan: WritePlan) -> TierWrite:
        job = self._new_job(JobKind.WRITE, "", plan.keys, {}, plan=plan)
        return TierWrite(job.job_id, plan.keys, plan.host_slots, plan.lower_slots, plan.snapshot, plan.remote)

    def _plan_writes(self) -> list[TierWrite]:
        """Write-back snapshots of the blocks this step's stores and promotions evicted."""
        writes = [self._write_job(plan) for plan in self.chain.take_writes()]
        self.stats.add("tier_write_skipped_blocks", self.chain.skipped_writes)
        self.stats.add("tier_evicted_blocks", self.chain.lower_evictions)
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
        job = self._jobs[job_id]
        job.reports += count
        job.ok &= ok
        if job.reports < self.config.world_size:
            return
        del self._jobs[job_id]
        state = self._requests.get(job.req_id)
        if job.kind is JobKind.WRITE:
            assert isinstance(job.plan, WritePlan)
            self.chain.complete_write(job.plan, success=job.ok)
            tier = "remote" if job.plan.remote else "tier"
            if job.plan.remote:
                self._remote_writing -= len(job.keys)
            if job.ok:
                self.stats.add(f"{tier}_written_blocks", len(job.keys))
            else:
                self.stats.add(f"{tier}_failed_writes", 1)
            quarantine = self._quarantined.pop(job_id, None)
            if quarantine is not None:
                quarantine.writes.discard(job_id)
                if not quarantine.writes:  # every rank's writes from the slots ended
                    self.chain.complete_store(quarantine.keys, success=False)
            return
        if job.kind is JobKind.STORE:
            for block in job.blocks:
                readers = self._readers[block]
                readers.discard(job_id)
                if not readers:
                    del self._readers[block]
            if state is not None:
                state.store_jobs.discard(job_id)
            self._storing.difference_update(job.keys)
            write = job.plan if isinstance(job.plan, WritePlan) else None
            running = {w for w in job.writes if w in self._jobs}
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
            self._end_prefetch(job.plan, job.ok, time.monotonic() - job.started)
            if state is not None and state.prefetch is not None and state.prefetch.job_id == job_id:
                state.prefetch.done = True
        else:
            if state is not None and state.loading == job_id:
                state.loading = None
            if isinstance(job.plan, LoadPlan):  # None: the chain refused it, nothing to release
                self.chain.complete_load(job.plan, success=job.ok)
                if job.plan.promoted:
                    if job.ok:
                        self.stats.add("tier_loaded_blocks", len(job.plan.promoted))
                    else:
                        self.stats.add("tier_failed_loads", 1)
                if job.plan.fetched:
                    if job.ok:
                        self.stats.add("remote_loaded_blocks", len(job.plan.fetched))
                    else:
                        self.stats.add("remote_failed_loads", 1)
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
        events: list[KVCacheEvent] = []
        for event in self.manager.take_events():
            for key in event.keys:
                block_hash, group_id = split_offload_key(key)
                if event.removed:
                    events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM, group_idx=group_id))
                else:
                    events.append(
                        BlockStored(
                            block_hashes=[block_hash],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=self.config.block_size,
                            lora_id=None,
                            medium=MEDIUM,
                            lora_name=None,
                            group_idx=group_id,
                        )
                    )
        return events

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
        self._poll_local_reads()
        return bool(self._jobs or self._local_reads)

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
