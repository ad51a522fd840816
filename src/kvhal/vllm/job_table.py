"""The scheduler side's jobs in flight: what each is, and how many workers reported it.

A job (a load, a prefetch's read, a store, a write to a tier below) goes to every worker in
a step's metadata as a :class:`~kvhal.vllm.metadata.TransferJob` (or a
:class:`~kvhal.vllm.metadata.TierWrite`); the scheduler side keeps its record (:class:`Job`)
under its id until every worker reported it, then ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhal.tiers.chain import LoadPlan, WritePlan
from kvhal.vllm.metadata import JobKind, TierWrite, TransferJob


@dataclass
class Job:
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


class JobTable:
    """The jobs in flight of one scheduler side, by id (ids count up from 0).

    :param world_size: the workers that report each job.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._jobs: dict[int, Job] = {}
        self._next_job = 0

    def __getitem__(self, job_id: int) -> Job:
        return self._jobs[job_id]

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def new(
        self,
        kind: JobKind,
        req_id: str,
        keys: list[bytes],
        groups: dict[int, tuple[list[int], list[int]]],
        plan: LoadPlan | WritePlan | None = None,
    ) -> TransferJob:
        """A new job of ``req_id`` that moves ``keys`` (per group, device blocks and host slots)."""
        job_id = self._next_job
        self._next_job += 1
        blocks: frozenset[int] = frozenset()
        if kind is JobKind.STORE:
            blocks = frozenset(b for ids, _ in groups.values() for b in ids)
        self._jobs[job_id] = Job(kind, req_id, keys, blocks, plan=plan)
        return TransferJob(job_id, kind, req_id, groups)

    def new_prefetch(self, req_id: str, keys: list[bytes], plan: LoadPlan, started: float) -> TransferJob:
        """A workers' job that reads a prefetch into host slots (see :mod:`kvhal.vllm.prefetch`)."""
        job = self.new(JobKind.LOAD, req_id, keys, {}, plan=plan)
        job.prefetch = self._jobs[job.job_id].prefetch = True
        self._jobs[job.job_id].started = started
        return job

    def new_write(self, plan: WritePlan) -> TierWrite:
        """A workers' job that writes ``plan``'s blocks to a tier below."""
        job = self.new(JobKind.WRITE, "", plan.keys, {}, plan=plan)
        return TierWrite(job.job_id, plan.keys, plan.host_slots, plan.lower_slots, plan.snapshot, plan.remote)

    def report(self, job_id: int, count: int, ok: bool) -> Job | None:
        """``count`` workers reported ``job_id`` (``ok``: each succeeded): the job, ended, once
        every worker reported it, else None."""
        job = self._jobs[job_id]
        job.reports += count
        job.ok &= ok
        if job.reports < self.world_size:
            return None
        del self._jobs[job_id]
        return job
