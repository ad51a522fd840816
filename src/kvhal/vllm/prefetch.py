"""The scheduler side's prefetches: a hit found below the host tier read into host slots at lookup.

With tiers below host memory (``ConnectorConfig.tiers``), a lookup whose hit lies partly
below the host tier reads those blocks, each from the first tier holding it, into host
slots while vLLM is answered ``None``, then loads them as a host hit. The read is the
workers' job (a :class:`~kvhal.vllm.metadata.ReadJob` in the next step's metadata), or,
where the one worker shares this process (``local``: :mod:`kvhal.vllm.local`), the lookup's
own, waited for up to :data:`LOCAL_READ_WAIT_S`. Each tier has its wait policy
(:class:`~kvhal.offload.wait_policy.WaitPolicy`), which says how long a request may wait
for its read, or that recomputing is faster; every read that ends tells it how fast the
tier reads.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvhal.offload.manager import BlockState
from kvhal.offload.wait_policy import PROBE, PROBE_S, InFlight, WaitPolicy
from kvhal.tiers.backend import OK, ReadOutcome
from kvhal.tiers.chain import Held, LoadPlan, TierChain, TierRead
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.local import waits_whole
from kvhal.vllm.metadata import ReadJob
from kvhal.vllm.request_state import Prefetch, RequestState
from kvhal.vllm.stats import READ_FAILURE_COUNTERS, KVHALStats

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvhal.vllm.worker_side import WorkerSide

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: How long a lookup waits for a read through the in-process worker's tiers: a returning
#: user's blocks (about 10 MiB) take a few milliseconds from a disk of 2.7 GB/s, an engine
#: step of the others' decode about 65 ms (the CPU benchmarks); a read not done by then is
#: waited for as a prefetch (``None`` answers) until its tiers' waits. Where the engine
#: computes on the host's cores (:func:`~kvhal.vllm.local.waits_whole`), the lookup waits for
#: the read longer (:data:`WHOLE_WAIT_READS`): a forward beside it would slow both.
LOCAL_READ_WAIT_S = 0.02
#: Where a lookup waits whole for its read, it waits up to this many times the read's predicted
#: time (and its deadline at most): :meth:`Prefetcher._whole_wait`.
WHOLE_WAIT_READS = 3
#: Steps after its read ends that the scheduler side learns of a workers' prefetch: it
#: starts at the next step, and ends in that step's output or the one after.
WORKER_READ_STEPS = 2


class Started(enum.Enum):
    """What :meth:`Prefetcher.start` did for a lookup."""

    #: no prefetch (off for a tier, over its budget, tried already, no host room): the hit
    #: loads asynchronously, reading then copying
    NO = "no"
    #: the read goes on: the request waits for it (the lookup answers ``None``)
    WAITING = "waiting"
    #: the read was made and ended in the lookup: its blocks are host blocks now
    READ_NOW = "read_now"
    #: reading would be slower than recomputing (or reads only to measure a tier)
    RECOMPUTE = "recompute"


@dataclass
class LocalRead:
    """A read the scheduler side made through the in-process worker's tiers (``local``):
    one future per tier it reads."""

    plan: LoadPlan
    futures: dict[str, Future[list[ReadOutcome]]]
    state: RequestState
    started: float
    ended: dict[str, float] = field(default_factory=dict)  # by the futures' callbacks
    #: until when a lookup waiting whole waits for it (:meth:`Prefetcher.wait_local`)
    wait_until: float = 0.0

    def __post_init__(self) -> None:
        for name, future in self.futures.items():
            future.add_done_callback(lambda _, name=name: self.ended.__setitem__(name, time.monotonic()))

    def done(self) -> bool:
        return all(future.done() for future in self.futures.values())


class Prefetcher:
    """The prefetches of one scheduler side, from every tier below the host tier.

    :param waits: each tier's wait policy, by name (``None``: no prefetch from it).
    :param new_job: makes the workers' job that reads a prefetch, registered scheduler-side.
    :param local: the engine's one worker side where it runs in this process: its tiers are
        read at lookup (:mod:`kvhal.vllm.local`); ``None``: reads are the workers' jobs.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        stats: KVHALStats,
        waits: dict[str, WaitPolicy | None],
        new_job: Callable[[str, LoadPlan, float], ReadJob],
        local: WorkerSide | None = None,
    ) -> None:
        self.config, self.stats = config, stats
        self.waits = waits
        self._new_job = new_job
        self.local = local
        self.reading = 0  # blocks being read by prefetches
        self._flights: dict[str, InFlight] = {}  # each tier's reads at once, from its first
        self._marks: dict[int, dict[str, tuple[float, float]]] = {}  # by id(plan): each read's start
        self.local_reads: list[LocalRead] = []
        self.jobs: list[ReadJob] = []  # the workers' prefetches for the next step's metadata
        #: start local reads without waiting for them (a lookup at the request's arrival,
        #: :func:`~kvhal.vllm.arrivals.arrived`): its lookup waits later
        self.defer = False

    def take_jobs(self) -> list[ReadJob]:
        """The workers' prefetches started since the last call."""
        jobs, self.jobs = self.jobs, []
        return jobs

    def start(
        self, chain: TierChain, state: RequestState, start: int, hashes: list[bytes], held: Held
    ) -> Started:
        """Read the blocks of ``hashes`` that only tiers below hold, each from the first tier
        holding it (a store's: in ``held``), into host slots now, for the request to wait for
        and then load as a host hit (see :class:`Started` for the answers). One prefetch per
        request; a tier reading slower than the engine computes makes the whole hit below
        the host tier recomputed, and a tier of unknown speed is read to measure it (a
        probe, which no request waits for)."""
        if state.prefetched:
            return Started.NO
        # The hit's host blocks are pinned with it (as a load's are), or the promotion's new
        # slots could evict them, the oldest, and the hit would be lost again.
        keys = [offload_key(h, g.group_id) for h in hashes for g in self.config.groups]
        below: dict[str, int] = {}
        for key in keys:
            if chain.host.state(key) is not BlockState.READY:
                tier = chain.holder(key, held)
                assert tier is not None, "a key below the host tier that no tier holds"
                below[tier.name] = below.get(tier.name, 0) + 1
        if any(self.waits.get(name) is None for name in below):
            return Started.NO  # a tier without prefetch: one load reads and copies
        worker = self.local if self.local is not None and self.local.tiers else None
        tokens = (len(hashes) - self.host_prefix(chain, hashes)) * self.config.block_size
        steps = 0 if worker is not None else WORKER_READ_STEPS
        waits: dict[str, float | None] = {}
        for name, blocks in below.items():
            policy = self.waits[name]
            assert policy is not None
            waits[name] = self._wait_for(name, policy, tokens, blocks * self.config.slot_bytes, steps)
        slow = [name for name, wait in waits.items() if wait is None]
        if slow:  # a tier reads slower than the engine computes
            for name in slow:
                self.stats.add_tier("tier_slow_blocks", name, below[name])
            return Started.RECOMPUTE
        probe = any(wait == PROBE for wait in waits.values())
        plan = None
        total = sum(below.values())
        if self.reading + total <= self.budget():
            positions = [start + i for i in range(len(hashes)) for _ in self.config.groups]
            plan = chain.prepare_load(keys, held, positions)
        if plan is None:  # over the budget, or no room in the host tier
            for name, blocks in below.items():
                self.stats.add_tier("tier_prefetch_skipped_blocks", name, blocks)
            return Started.RECOMPUTE if probe else Started.NO  # a tier of unknown speed is not waited for
        self.reading += len(plan.read_keys)
        self._marks[id(plan)] = {
            read.tier: self._flights.setdefault(read.tier, InFlight()).start(len(read.keys))
            for read in plan.reads
        }
        state.prefetched = True
        state.read_from = {read.tier: set(read.keys) for read in plan.reads}
        for read in plan.reads:
            self.stats.add_tier("tier_prefetched_blocks", read.tier, len(read.keys))
        now = time.monotonic()
        deadline = now + max(wait for wait in waits.values() if wait is not None)
        if worker is not None:  # the worker is in this process: read now, wait a little
            reads = {read.tier: _started(worker, read) for read in plan.reads}
            wait = min(deadline - now, LOCAL_READ_WAIT_S)
            if probe:
                wait = 0.0
            elif waits_whole(worker):
                wait = min(deadline - now, max(LOCAL_READ_WAIT_S, self._whole_wait(below)))
            local = LocalRead(plan, reads, state, now, wait_until=now + wait)
            self.local_reads.append(local)
            futures.wait(list(reads.values()), timeout=0.0 if self.defer else wait)
            self.poll_local_reads(chain)
            if local.done():
                return Started.READ_NOW
            if probe:  # it goes on, measured, waited for by no one
                self._count_probes(plan.reads)
                return Started.RECOMPUTE
            state.prefetch = Prefetch(-1, deadline, started=now)
            return Started.WAITING
        job = self._new_job(state.request.request_id, plan, now)
        self.jobs.append(job)
        if probe:
            self._count_probes(plan.reads)
            return Started.RECOMPUTE
        state.prefetch = Prefetch(job.job_id, deadline, started=now)
        return Started.WAITING

    def wait_local(self, state: RequestState) -> None:
        """Wait for ``state``'s read through the in-process worker, if one goes on, until its
        ``wait_until`` (a read started at the request's arrival, not waited for then)."""
        for read in self.local_reads:
            if read.state is state:
                futures.wait(
                    list(read.futures.values()), timeout=max(0.0, read.wait_until - time.monotonic())
                )
                return

    def _whole_wait(self, below: dict[str, int]) -> float:
        """How long a lookup waiting whole (:func:`~kvhal.vllm.local.waits_whole`) waits for its
        read: :data:`WHOLE_WAIT_READS` times the slowest tier's predicted read (unbounded
        before a tier's first read: its deadline bounds it). A read that stalls is then
        waited for as a prefetch (``None`` answers), the engine stepping meanwhile, not held
        for the whole deadline (a store stopped mid-read)."""
        longest = 0.0
        for name, blocks in below.items():
            policy = self.waits.get(name)
            predicted = policy.read_seconds(blocks * self.config.slot_bytes) if policy is not None else None
            if predicted is None:
                return math.inf
            longest = max(longest, predicted)
        return WHOLE_WAIT_READS * longest

    def _wait_for(self, name: str, policy: WaitPolicy, tokens: int, nbytes: int, steps: int) -> float | None:
        """``policy.wait_for``, and the operator told when the tier turns slow or fast again."""
        was_slow = policy.slow
        wait = policy.wait_for(tokens, nbytes, steps_to_see=steps)
        if policy.slow != was_slow:  # an operator sees why hits stopped (or started again)
            logger.info(
                "kvhal: the %s tier now reads %s than recomputing (%.1f MiB predicted in %.0f ms, "
                "%d tokens recomputed in %.0f ms)%s",
                name,
                "slower" if policy.slow else "faster",
                nbytes / (1 << 20),
                1000 * (policy.read_seconds(nbytes) or 0.0),
                tokens,
                1000 * (policy.steps.seconds(tokens) or 0.0),
                f": its hits are recomputed, and it is read again every {PROBE_S:.0f} s to see"
                if policy.slow
                else "",
            )
        return wait

    def _count_probes(self, reads: list[TierRead]) -> None:
        for read in reads:
            self.stats.add_tier("tier_probes", read.tier, 1)

    def budget(self) -> int:
        """Blocks prefetches may read at once, from every tier below together: the first local
        tier's ``prefetch_blocks``, else half the host tier's slots."""
        for tier in self.config.tiers:
            budget = getattr(tier, "prefetch_blocks", None)
            if budget:
                return budget
        return max(1, self.config.num_slots // 2)

    def host_prefix(self, chain: TierChain, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, the host tier holds ready (every group's)."""
        for i, block_hash in enumerate(hashes):
            if any(
                chain.host.state(offload_key(block_hash, g.group_id)) is not BlockState.READY
                for g in self.config.groups
            ):
                return i
        return len(hashes)

    def poll_local_reads(self, chain: TierChain) -> None:
        """End the reads made through the in-process worker's tiers that finished."""
        for read in [r for r in self.local_reads if r.done()]:
            self.local_reads.remove(read)
            ok: dict[str, bool] = {}
            lost: set[bytes] = set()
            for tier_read in read.plan.reads:
                future = read.futures[tier_read.tier]
                try:
                    outcomes = future.result()
                except Exception:
                    logger.exception("kvhal: a read of the %s tier raised", tier_read.tier)
                    outcomes = [ReadOutcome.IO_ERROR] * len(tier_read.keys)
                failed = [
                    key for key, outcome in zip(tier_read.keys, outcomes, strict=True) if outcome is not OK
                ]
                for outcome in outcomes:
                    if outcome is not OK:
                        self.stats.add_tier(READ_FAILURE_COUNTERS[outcome], tier_read.tier, 1)
                good = len(outcomes) - len(failed)
                self.stats.add_tier("tier_read_bytes", tier_read.tier, good * self.config.slot_bytes)
                ok[tier_read.tier] = not failed
                lost.update(failed)
            seconds = {name: ended - read.started for name, ended in read.ended.items()}
            self.end_read(chain, read.state, -1, read.plan, ok, seconds, lost)

    def end_read(
        self,
        chain: TierChain,
        state: RequestState | None,
        job_id: int,
        plan: LoadPlan,
        ok: dict[str, bool],
        seconds: dict[str, float],
        lost: set[bytes] | None = None,
    ) -> None:
        """A prefetch's read ended (the workers' job ``job_id``, or -1 for a read through the
        in-process worker; ``ok`` and ``seconds`` after it started, by tier, where known): its
        blocks are host blocks now, or forgotten (a failed read may have found them corrupt),
        and the request waiting for it (``state``, if not finished) waits no more. ``lost``:
        where each block's outcome is known (a read through the in-process worker), the
        blocks whose reads failed; only they are forgotten, so a block gone from a store (an
        object expired between the names a lookup asked) costs the hit from that block on,
        not the whole hit. Without it, a tier's failed read forgets every block read."""
        self.reading -= len(plan.read_keys)
        marks = self._marks.pop(id(plan), {})
        shares = {
            read.tier: self._flights[read.tier].end(len(read.keys), marks[read.tier])
            for read in plan.reads
            if read.tier in marks
        }
        if lost is None:
            chain.complete_load(plan, success=all(ok.values()))
        else:
            chain.complete_load(plan, failed=lost)
        for read in plan.reads:
            if read.tier in seconds:
                self.stats.observe("tier_read_seconds", read.tier, seconds[read.tier])
            if not ok.get(read.tier, False):
                self.stats.add_tier("tier_failed_loads", read.tier, 1)
                if state is not None:
                    state.forget_read(
                        read.tier, read.keys if lost is None else [k for k in read.keys if k in lost]
                    )
                continue
            self.stats.add_tier("tier_loaded_blocks", read.tier, len(read.keys))
            policy = self.waits.get(read.tier)
            if policy is not None and read.tier in seconds:
                # its time alone: reads at once share the tier (InFlight)
                alone = seconds[read.tier] * shares.get(read.tier, 1.0)
                policy.observe_read(len(read.keys) * self.config.slot_bytes, alone)
        waiting = state.prefetch if state is not None else None
        if waiting is not None and waiting.job_id == job_id:
            waiting.done = True


def _started(worker: WorkerSide, read: TierRead) -> Future[list[ReadOutcome]]:
    """``read`` started through the in-process worker; a tier that refuses it at once gives
    a failed future (its read is an I/O error, ended as any other with the reads started)."""
    try:
        return worker.read_tier(read)
    except Exception as exc:
        refused: Future[list[ReadOutcome]] = Future()
        refused.set_exception(exc)
        return refused
