"""A job in flight on a worker, whatever its kind, and what it waits for (the worker side keeps
every one in one table, :class:`~kvhal.vllm.worker_side.WorkerSide`); the submission of a
step's copies, one plan and one ordering for all of them; the timer of the worker side's calls
on the engine's thread."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvhal.cache import KVCache
from kvhal.offload.transfer import TransferEngine
from kvhal.tiers.backend import ReadOutcome
from kvhal.tiers.chain import TierRead
from kvhal.vllm.metadata import LoadJob, ReadJob, StoreJob, WriteJob

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level


@dataclass
class Running:
    """A job in flight on this worker and what it waits for.

    :param copies: its device copies (the transfer engine's jobs).
    :param reads: a load's or a read job's reads into host slots, by tier.
    :param write: a write job's write.
    :param deadline: when a load's reads are given up (its request recomputed).
    :param gave_up: reported failed to vLLM; the job ends once its reads end.
    """

    job: LoadJob | StoreJob | ReadJob | WriteJob
    copies: set[int] = field(default_factory=set)
    reads: dict[str, tuple[TierRead, Future[list[ReadOutcome]]]] = field(default_factory=dict)
    write: Future[list[bool]] | None = None
    deadline: float | None = None
    gave_up: bool = False
    ok: bool = True

    @property
    def sync(self) -> bool:
        return isinstance(self.job, LoadJob) and self.job.sync


def on_engine_thread(method: F) -> F:
    """Count the time a step spends in kvhal: what it can add to the engine's critical path."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            self.stats.add("worker_busy_us", int(elapsed * 1e6))

    return timed  # type: ignore[return-value]


def submit_copies(
    engine: TransferEngine,
    caches: Mapping[int, KVCache],
    host_views: Mapping[int, KVCache],
    jobs: Sequence[LoadJob | StoreJob],
) -> tuple[dict[int, set[int]], set[int]]:
    """Submit the device copies of ``jobs`` (all loads or all stores): per KV cache group, one
    copy for every job's blocks -- one plan and one ordering after the compute stream, not one
    per job (about 65 us of Python each on the CPU plugin). A batch the device refuses is
    submitted job by job, so that a bad job fails alone; a batch's copy that fails fails each
    of its jobs.

    :return: each job's copies (the transfer engine's job ids, shared by a batch's jobs), and
        the jobs with a copy refused.
    """
    copies: dict[int, set[int]] = {job.job_id: set() for job in jobs}
    refused: set[int] = set()
    gids = list(dict.fromkeys(gid for job in jobs for gid, (ids, _) in job.groups.items() if ids))
    for gid in gids:
        members = [job for job in jobs if job.groups.get(gid, ((), ()))[0]]
        if len(members) > 1:
            try:
                copy = _submit(engine, caches[gid], host_views[gid], members, gid)
            except Exception:  # refused whole: job by job below, each refusal named
                pass
            else:
                for job in members:
                    copies[job.job_id].add(copy)
                continue
        for job in members:
            try:
                copies[job.job_id].add(_submit(engine, caches[gid], host_views[gid], [job], gid))
            except Exception:  # a refused copy fails the job; the engine recomputes or skips it
                logger.exception("kvhal: %s job %d refused", type(job).__name__, job.job_id)
                refused.add(job.job_id)
    return copies, refused


def _submit(
    engine: TransferEngine, cache: KVCache, host: KVCache, jobs: Sequence[LoadJob | StoreJob], gid: int
) -> int:
    """One copy of group ``gid``'s blocks of every one of ``jobs``."""
    pairs: list[tuple[int, int]] = []
    keys = ()  # the manager's keys stay scheduler-side; jobs are tracked by id
    if isinstance(jobs[0], StoreJob):
        for job in jobs:
            block_ids, slots = job.groups[gid]
            pairs += zip(block_ids, slots, strict=True)
        return engine.submit_store(keys, cache, host, pairs)
    for job in jobs:
        block_ids, slots = job.groups[gid]
        pairs += zip(slots, block_ids, strict=True)
    return engine.submit_load(keys, host, cache, pairs)
