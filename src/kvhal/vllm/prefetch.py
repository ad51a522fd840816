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

import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from vllm.logger import init_logger

from kvhal.offload.manager import BlockState
from kvhal.offload.wait_policy import PROBE, PROBE_S, WaitPolicy
from kvhal.tiers.backend import OK
from kvhal.tiers.chain import LoadPlan, TierChain
from kvhal.vllm import local
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.metadata import TierReads, TransferJob
from kvhal.vllm.request_state import Prefetch, RequestState
from kvhal.vllm.stats import REMOTE_READ_COUNTERS, TIER_READ_COUNTERS, KVHALStats

logger = init_logger("vllm." + __name__)  # under "vllm": its handlers and level

#: How long a lookup waits for a read of the in-process worker's tier: a returning user's
#: blocks (about 10 MiB) take a few milliseconds from a disk of 2.7 GB/s, an engine step of
#: the others' decode about 65 ms (the CPU benchmarks); a read not done by then is waited
#: for as a prefetch (``None`` answers) until ``lower_tier_wait_ms``.
LOCAL_READ_WAIT_S = 0.02
#: Steps after its read ends that the scheduler side learns of a workers' prefetch: it
#: starts at the next step, and ends in that step's output or the one after.
WORKER_READ_STEPS = 2
#: :meth:`Prefetcher.start`'s answer for a read made and ended in the lookup.
READ_NOW = object()
#: :meth:`Prefetcher.start`'s answer when reading would be slower than recomputing.
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
#: Makes the workers' prefetch job of a request: (request id, keys it reads, plan, start).
NewJob = Callable[[str, list[bytes], LoadPlan, float], TransferJob]


@dataclass
class LocalRead:
    """A read the scheduler side made through the in-process worker's tier (``local``)."""

    plan: LoadPlan
    future: Future[list[str | None]]
    state: RequestState
    started: float
    ended: float | None = None  # set by the future's callback, on the reading thread
    remote: bool = False  # a read of the remote tier (else the lower tier)

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._end)

    def _end(self, _: Future[list[str | None]]) -> None:
        self.ended = time.monotonic()


class Prefetcher:
    """The prefetches of one scheduler side, from the lower tier and from the remote tier.

    :param wait_policy: the lower tier's wait policy (``None``: no prefetch from it).
    :param remote_wait: the remote tier's (``None``: none from it).
    :param new_job: makes the workers' job that reads a prefetch, registered scheduler-side.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        stats: KVHALStats,
        wait_policy: WaitPolicy | None,
        remote_wait: WaitPolicy | None,
        new_job: NewJob,
    ) -> None:
        self.config, self.stats = config, stats
        self.wait_policy, self.remote_wait = wait_policy, remote_wait
        self._new_job = new_job
        self.reading = 0  # blocks being read by prefetches
        self.local_reads: list[LocalRead] = []
        self.jobs: list[TransferJob] = []  # the workers' prefetches for the next step's metadata

    def take_jobs(self) -> list[TransferJob]:
        """The workers' prefetches started since the last call."""
        jobs, self.jobs = self.jobs, []
        return jobs

    def start(
        self, chain: TierChain, state: RequestState, hashes: list[bytes], remote: bool = False
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
        below = [key for key in keys if chain.host.state(key) is not BlockState.READY]
        lower = chain.lower
        if remote and lower is not None and any(lower.state(k) is BlockState.READY for k in below):
            return False  # the lower tier holds some too: one load reads both, as before
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
            self.stats.add(PREFETCH_COUNTERS["slow"][remote], len(below))
            return RECOMPUTE
        probe = wait == PROBE
        plan = None
        if self.reading + len(below) <= self.budget():
            plan = chain.prepare_load(keys, fetch=state.fetch if remote else ())
        if plan is None:  # over the budget, or no room in the host tier
            self.stats.add(PREFETCH_COUNTERS["skipped"][remote], len(below))
            return RECOMPUTE if probe else False  # a tier of unknown speed is not waited for
        read = plan.fetched if remote else plan.promoted
        self.reading += len(read)
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
            self.local_reads.append(LocalRead(plan, future, state, now, remote=remote))
            futures.wait([future], timeout=0.0 if probe else min(wait, LOCAL_READ_WAIT_S))
            self.poll_local_reads(chain)
            if future.done():
                return READ_NOW
            if probe:  # it goes on, measured, waited for by no one
                self.stats.add(PREFETCH_COUNTERS["probes"][remote], 1)
                return RECOMPUTE
            state.prefetch = Prefetch(-1, deadline, started=now, remote=remote)
            return True
        job = self._new_job(state.request.request_id, read, plan, now)
        if remote:
            job.remote_reads = TierReads(plan.fetched, [], plan.fetched_host_slots)
        else:
            job.reads = TierReads(plan.promoted, plan.lower_slots, plan.promoted_host_slots)
        self.jobs.append(job)
        if probe:
            self.stats.add(PREFETCH_COUNTERS["probes"][remote], 1)
            return RECOMPUTE
        state.prefetch = Prefetch(job.job_id, deadline, started=now, remote=remote)
        return True

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
                outcomes = ["io_error"] * len(keys)
            counters = REMOTE_READ_COUNTERS if read.remote else TIER_READ_COUNTERS
            failed = [outcome for outcome in outcomes if outcome is not OK]
            for outcome in failed:
                self.stats.add(counters.get(outcome, counters["io_error"]), 1)
            good = len(outcomes) - len(failed)
            self.stats.add(PREFETCH_COUNTERS["read_bytes"][read.remote], good * self.config.slot_bytes)
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
            self.stats.add(PREFETCH_COUNTERS["failed"][remote], 1)
        else:
            self.stats.add(PREFETCH_COUNTERS["loaded"][remote], len(keys))
            policy = self.remote_wait if remote else self.wait_policy
            if policy is not None and seconds is not None:
                policy.observe_read(len(keys) * self.config.slot_bytes, seconds)
        waiting = state.prefetch if state is not None else None  # this read's, not the other tier's
        if waiting is not None and waiting.job_id == job_id and waiting.remote == remote:
            waiting.done = True
