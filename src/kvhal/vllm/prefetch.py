"""The scheduler side's prefetches: a hit found below the host tier read into host slots at lookup.

With a tier below host memory (``disk_path``, or a plugin's backend) or a remote tier, a
lookup whose hit lies partly below the host tier reads those blocks into host slots while
vLLM is answered ``None``, then loads them as a host hit. The read is the workers' job
(a :class:`~kvhal.vllm.metadata.TransferJob` in the next step's metadata), or, where the one
worker shares this process (:mod:`kvhal.vllm.local`), the lookup's own, waited for up to
:data:`LOCAL_READ_WAIT_S`. Each tier has its wait policy
(:class:`~kvhal.offload.wait_policy.WaitPolicy`: ``lower_tier_wait_ms``,
``remote_load_timeout_ms``), which says how long a request may wait for its read, or that
recomputing is faster; every read that ends tells it how fast the tier reads.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from vllm.logger import init_logger

from kvhal.offload.manager import BlockState
from kvhal.offload.wait_policy import PROBE, PROBE_S, WaitPolicy
from kvhal.tiers.backend import OK, ReadOutcome
from kvhal.tiers.chain import LoadPlan, TierChain
from kvhal.vllm import local
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.metadata import TierReads, TransferJob
from kvhal.vllm.request_state import Prefetch, RequestState
from kvhal.vllm.stats import READ_FAILURE_COUNTERS, KVHALStats

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level

#: How long a lookup waits for a read of the in-process worker's tier: a returning user's
#: blocks (about 10 MiB) take a few milliseconds from a disk of 2.7 GB/s, an engine step of
#: the others' decode about 65 ms (the CPU benchmarks); a read not done by then is waited
#: for as a prefetch (``None`` answers) until ``lower_tier_wait_ms``.
LOCAL_READ_WAIT_S = 0.02
#: Steps after its read ends that the scheduler side learns of a workers' prefetch: it
#: starts at the next step, and ends in that step's output or the one after.
WORKER_READ_STEPS = 2


class Started(enum.Enum):
    """What :meth:`Prefetcher.start` did for a lookup."""

    #: no prefetch (off, over its budget, tried already, no host room): the hit loads
    #: asynchronously, reading then copying
    NO = "no"
    #: the read goes on: the request waits for it (the lookup answers ``None``)
    WAITING = "waiting"
    #: the read was made and ended in the lookup: its blocks are host blocks now
    READ_NOW = "read_now"
    #: reading would be slower than recomputing (or reads only to measure the tier)
    RECOMPUTE = "recompute"


#: Makes the workers' prefetch job of a request: (request id, keys it reads, plan, start).
NewJob = Callable[[str, list[bytes], LoadPlan, float], TransferJob]


@dataclass
class LocalRead:
    """A read the scheduler side made through the in-process worker's tier (``local``)."""

    plan: LoadPlan
    future: Future[list[ReadOutcome]]
    state: RequestState
    started: float
    ended: float | None = None  # set by the future's callback, on the reading thread
    remote: bool = False  # a read of the remote tier (else the lower tier)

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._end)

    def _end(self, _: Future[list[ReadOutcome]]) -> None:
        self.ended = time.monotonic()


class Prefetcher:
    """The prefetches of one scheduler side, from the lower tier and from the remote tier.

    :param wait_policy: the lower tier's wait policy (``None``: no prefetch from it).
    :param remote_wait: the remote tier's (``None``: none from it).
    :param new_job: makes the workers' job that reads a prefetch, registered scheduler-side.
    :param tier_names: the lower tier's name and the remote tier's, for their counters.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        stats: KVHALStats,
        wait_policy: WaitPolicy | None,
        remote_wait: WaitPolicy | None,
        new_job: NewJob,
        tier_names: tuple[str, str] = ("lower", "remote"),
    ) -> None:
        self.config, self.stats = config, stats
        self.wait_policy, self.remote_wait = wait_policy, remote_wait
        self._new_job = new_job
        #: the counters' tier names: (the lower tier's, the remote tier's)
        self.tier_names = tier_names
        self.reading = 0  # blocks being read by prefetches
        self.local_reads: list[LocalRead] = []
        self.jobs: list[TransferJob] = []  # the workers' prefetches for the next step's metadata

    def take_jobs(self) -> list[TransferJob]:
        """The workers' prefetches started since the last call."""
        jobs, self.jobs = self.jobs, []
        return jobs

    def start(
        self, chain: TierChain, state: RequestState, hashes: list[bytes], remote: bool = False
    ) -> Started:
        """Read the blocks of ``hashes`` that only a tier below holds (the lower tier, or the
        remote tier's blocks in ``state.fetch`` if ``remote``) into host slots now, for the
        request to wait for (``None`` answers; :attr:`Started.WAITING`) and then load as a host
        hit. :attr:`Started.NO` (the hit loads asynchronously, reading then copying) when the
        prefetch is off, over its budget, was tried for this request already, or the host tier has no room.
        :attr:`Started.READ_NOW` when the read was made and ended in this call (the in-process
        worker's tier, :mod:`kvhal.vllm.local`). :attr:`Started.RECOMPUTE` when the wait policy says
        the tier is slower than recomputing, or reads it only to measure it (a probe, which
        no request waits for)."""
        policy = self.remote_wait if remote else self.wait_policy
        if policy is None or (state.remote_prefetched if remote else state.prefetched):
            return Started.NO
        # The hit's host blocks are pinned with it (as a load's are), or the promotion's new
        # slots could evict them, the oldest, and the hit would be lost again.
        keys = [offload_key(h, g.group_id) for h in hashes for g in self.config.groups]
        below = [key for key in keys if chain.host.state(key) is not BlockState.READY]
        lower = chain.lower
        if remote and lower is not None and any(lower.state(k) is BlockState.READY for k in below):
            return Started.NO  # the lower tier holds some too: one load reads both, as before
        host = self.host_prefix(chain, hashes)
        worker = local.find(self.config.engine_id) if self.config.world_size == 1 else None
        reader = None if worker is None else worker.remote if remote else worker.tier_io
        was_slow = policy.slow
        tokens, nbytes = (len(hashes) - host) * self.config.block_size, len(below) * self.config.slot_bytes
        wait = policy.wait_for(tokens, nbytes, steps_to_see=0 if reader is not None else WORKER_READ_STEPS)
        if policy.slow != was_slow:  # an operator sees why hits stopped (or started again)
            logger.info(
                "kvhal: the %s tier now reads %s than recomputing (%.1f MiB predicted in %.0f ms, "
                "%d tokens recomputed in %.0f ms)%s",
                "remote" if remote else "lower",
                "slower" if policy.slow else "faster",
                nbytes / (1 << 20),
                1000 * (policy.read_seconds(nbytes) or 0.0),
                tokens,
                1000 * (policy.steps.seconds(tokens) or 0.0),
                f": its hits are recomputed, and it is read again every {PROBE_S:.0f} s to see"
                if policy.slow
                else "",
            )
        if wait is None:  # the tier reads slower than the engine computes
            self.stats.add_tier("tier_slow_blocks", self.tier_names[remote], len(below))
            return Started.RECOMPUTE
        probe = wait == PROBE
        plan = None
        if self.reading + len(below) <= self.budget():
            plan = chain.prepare_load(keys, fetch=state.fetch if remote else ())
        if plan is None:  # over the budget, or no room in the host tier
            self.stats.add_tier("tier_prefetch_skipped_blocks", self.tier_names[remote], len(below))
            return Started.RECOMPUTE if probe else Started.NO  # a tier of unknown speed is not waited for
        read = plan.fetched if remote else plan.promoted
        self.reading += len(read)
        if remote:
            state.remote_prefetched, state.from_store = True, set(read)
        else:
            state.prefetched, state.from_below = True, set(read)
        self.stats.add_tier("tier_prefetched_blocks", self.tier_names[remote], len(read))
        now = time.monotonic()
        deadline = now + wait
        if reader is not None:  # the worker is in this process: read now, wait a little
            if remote:
                future = reader.read(plan.fetched, plan.fetched_host_slots)
            else:
                future = reader.read(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
            self.local_reads.append(LocalRead(plan, future, state, now, remote=remote))
            futures.wait([future], timeout=0.0 if probe else min(wait, LOCAL_READ_WAIT_S))
            self.poll_local_reads(chain)
            if future.done():
                return Started.READ_NOW
            if probe:  # it goes on, measured, waited for by no one
                self.stats.add_tier("tier_probes", self.tier_names[remote], 1)
                return Started.RECOMPUTE
            state.prefetch = Prefetch(-1, deadline, started=now, remote=remote)
            return Started.WAITING
        job = self._new_job(state.request.request_id, read, plan, now)
        if remote:
            job.remote_reads = TierReads(plan.fetched, [], plan.fetched_host_slots)
        else:
            job.reads = TierReads(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
        self.jobs.append(job)
        if probe:
            self.stats.add_tier("tier_probes", self.tier_names[remote], 1)
            return Started.RECOMPUTE
        state.prefetch = Prefetch(job.job_id, deadline, started=now, remote=remote)
        return Started.WAITING

    def budget(self) -> int:
        """Blocks prefetches may read at once, from every tier below together."""
        lower = self.config.lower_tier
        return (lower.prefetch_blocks if lower is not None else None) or max(1, self.config.num_slots // 2)

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
        """End the reads made through the in-process worker's tier that finished."""
        for read in [r for r in self.local_reads if r.future.done()]:
            self.local_reads.remove(read)
            keys = read.plan.fetched if read.remote else read.plan.promoted
            try:
                outcomes = read.future.result()
            except Exception:
                logger.exception("kvhal: a read of the %s tier raised", "remote" if read.remote else "lower")
                outcomes = [ReadOutcome.IO_ERROR] * len(keys)
            failed = [outcome for outcome in outcomes if outcome is not OK]
            for outcome in failed:
                self.stats.add_tier(READ_FAILURE_COUNTERS[outcome], self.tier_names[read.remote], 1)
            good = len(outcomes) - len(failed)
            self.stats.add_tier(
                "tier_read_bytes", self.tier_names[read.remote], good * self.config.slot_bytes
            )
            seconds = None if read.ended is None else read.ended - read.started
            self.end_read(chain, read.state, -1, read.plan, not failed, seconds)

    def end_read(
        self,
        chain: TierChain,
        state: RequestState | None,
        job_id: int,
        plan: LoadPlan,
        ok: bool,
        seconds: float | None,
    ) -> None:
        """A prefetch's read ended (the workers' job ``job_id``, or -1 for a read of the
        in-process worker's tier; ``seconds`` after it started, if known): its blocks are host
        blocks now, or forgotten (a failed read may have found them corrupt), and the request
        waiting for it (``state``, if not finished) waits no more."""
        remote = bool(plan.fetched)  # a prefetch reads one tier: the remote tier's, or the lower's
        keys = plan.fetched if remote else plan.promoted
        self.reading -= len(keys)
        chain.complete_load(plan, success=ok)
        if not ok:
            self.stats.add_tier("tier_failed_loads", self.tier_names[remote], 1)
        else:
            self.stats.add_tier("tier_loaded_blocks", self.tier_names[remote], len(keys))
            policy = self.remote_wait if remote else self.wait_policy
            if policy is not None and seconds is not None:
                policy.observe_read(len(keys) * self.config.slot_bytes, seconds)
        waiting = state.prefetch if state is not None else None  # this read's, not the other tier's
        if waiting is not None and waiting.job_id == job_id and waiting.remote == remote:
            waiting.done = True
