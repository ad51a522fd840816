"""The scheduler side's jobs in flight: each job, what only the scheduler knows of it, and
how many workers reported it.

A job goes to every worker in a step's metadata (:mod:`kvhal.vllm.metadata`); the scheduler
side keeps it here, in a :class:`Pending`, under its id until every worker reported it,
then ends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvhal.tiers.chain import LoadPlan, WritePlan
from kvhal.vllm.metadata import Groups, LoadJob, ReadJob, StoreJob, WriteJob

Job = LoadJob | StoreJob | ReadJob | WriteJob


@dataclass
class Pending:
    """A job in flight and what the scheduler side keeps of it.

    :param keys: the blocks it moves (a store's: those it copies to host slots).
    :param plan: a load's or a read's plan in the tier chain (``None``: a load the chain
        refused), or a write's.
    :param blocks: a store's source block ids, every group's (what a fence protects).
    :param tenant: a store's request's tenant label (:mod:`kvhal.vllm.tenants`), or None.
    :param started: when the job started (a prefetch: its read): its time, to the step that
        reports it (one ``time.monotonic()`` per job, for the latency histograms).
    """

    job: Job
    keys: list[bytes]
    plan: LoadPlan | WritePlan | None = None
    blocks: frozenset[int] = frozenset()
    tenant: str | None = None
    started: float = 0.0
    reports: int = 0
    ok: bool = True


class JobTable:
    """The jobs in flight of one scheduler side, by id (ids count up from 0).

    :param world_size: the workers that report each job.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._jobs: dict[int, Pending] = {}
        self._next_job = 0

    def __getitem__(self, job_id: int) -> Pending:
        return self._jobs[job_id]

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def pending(self) -> Iterable[Pending]:
        """The jobs in flight."""
        return self._jobs.values()

    def _id(self) -> int:
        job_id = self._next_job
        self._next_job += 1
        return job_id

    def load(self, req_id: str, keys: list[bytes], groups: Groups, plan: LoadPlan | None) -> LoadJob:
        """A load of ``req_id``'s ``keys`` (per group, device blocks and host slots)."""
        job = LoadJob(self._id(), req_id, groups, reads=list(plan.reads) if plan is not None else [])
        self._jobs[job.job_id] = Pending(job, keys, plan, started=time.monotonic())
        return job

    def store(self, req_id: str, keys: list[bytes], groups: Groups, tenant: str | None = None) -> StoreJob:
        """A store of ``req_id``'s ``keys`` (per group, device blocks and host slots)."""
        job = StoreJob(self._id(), req_id, groups)
        blocks = frozenset(b for ids, _ in groups.values() for b in ids)
        pending = Pending(job, keys, blocks=blocks, tenant=tenant, started=time.monotonic())
        self._jobs[job.job_id] = pending
        return job

    def read(self, req_id: str, plan: LoadPlan, started: float) -> ReadJob:
        """A prefetch: ``plan``'s reads into host slots (see :mod:`kvhal.vllm.prefetch`)."""
        job = ReadJob(self._id(), req_id, list(plan.reads))
        self._jobs[job.job_id] = Pending(job, plan.read_keys, plan, started=started)
        return job

    def write(self, plan: WritePlan) -> WriteJob:
        """A write of ``plan``'s blocks to its tier."""
        job = WriteJob(
            self._id(), plan.tier, plan.keys, plan.host_slots, plan.slots, plan.snapshot, plan.positions
        )
        self._jobs[job.job_id] = Pending(job, plan.keys, plan, started=time.monotonic())
        return job

    def report(self, job_id: int, count: int, ok: bool) -> Pending | None:
        """``count`` workers reported ``job_id`` (``ok``: each succeeded): the job, ended, once
        every worker reported it, else None."""
        pending = self._jobs[job_id]
        pending.reports += count
        pending.ok &= ok
        if pending.reports < self.world_size:
            return None
        del self._jobs[job_id]
        return pending
