"""The transfer engine: store and load jobs through the device plugin, asynchronously.

It runs where the KV cache is (vLLM's worker process) and needs no manager:
each job carries the caller's keys back in its :class:`TransferResult`, and
an optional listener hears every result. :class:`~kvhal.offload.offloader.Offloader`
wires it to a manager in one process.

A job is checked whole before any byte moves (:meth:`Device.plan_copy
<kvhal.device.Device.plan_copy>`): a bad one raises and never exists. After
that every failure -- the plugin raising at submission, or the copy's event
raising :class:`~kvhal.errors.TransferError` -- is a result with
``success=False``, so a caller handles device failures in one place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvhal.cache import KVCache
from kvhal.copyplan import BlockMapping, CopyPlan
from kvhal.device import Device
from kvhal.errors import KVHALError, ValidationError


class TransferKind(str, enum.Enum):
    STORE = "store"  # device -> host tier
    LOAD = "load"  # host tier -> device


@dataclass(frozen=True)
class TransferResult:
    """A finished job.

    :param failed_block_ids: the destination block ids a failed job left
        without valid KV (device blocks for a load: recompute them; host
        slots for a store); empty on success.
    :param error: why it failed, or ``None``.
    """

    job_id: int
    kind: TransferKind
    success: bool
    keys: tuple[bytes, ...]
    failed_block_ids: tuple[int, ...] = ()
    error: str | None = None


@dataclass(eq=False)
class _Job:
    kind: TransferKind
    keys: tuple[bytes, ...]
    plan: CopyPlan
    event: Any = None
    error: str | None = None


class TransferEngine:
    """Submits block copies between device caches and the host tier, and reports them.

    :param device: the device facade copies go through (one stream per direction,
        each copy ordered after the compute stream by the facade).
    :param listener: called with each :class:`TransferResult` as :meth:`poll` or
        :meth:`wait` finds it finished.
    """

    def __init__(self, device: Device, *, listener: Callable[[TransferResult], None] | None = None) -> None:
        self.device = device
        self.listener = listener
        self._streams: dict[TransferKind, Any] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_id = 0

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._jobs)

    def submit_store(self, keys: Sequence[bytes], src: KVCache, dst: KVCache, mapping: BlockMapping) -> int:
        """Copy device blocks to host slots: ``mapping = [(device block, slot), ...]``.

        :param keys: the blocks' keys, one per pair (or empty: the caller tracks jobs by id).
        :raises ValidationError: the copy is invalid (nothing moved, no job).
        :return: the job id.
        """
        return self._submit(TransferKind.STORE, keys, src, dst, mapping)

    def submit_load(self, keys: Sequence[bytes], src: KVCache, dst: KVCache, mapping: BlockMapping) -> int:
        """Copy host slots to device blocks: ``mapping = [(slot, device block), ...]``.

        See :meth:`submit_store`.
        """
        return self._submit(TransferKind.LOAD, keys, src, dst, mapping)

    def _submit(
        self, kind: TransferKind, keys: Sequence[bytes], src: KVCache, dst: KVCache, mapping: BlockMapping
    ) -> int:
        return self.submit_plan(kind, self.device.plan_copy(src, dst, mapping), keys)

    def submit_plan(
        self, kind: TransferKind, plan: CopyPlan, keys: Sequence[bytes] = (), *, after_compute: bool = True
    ) -> int:
        """Submit a copy already checked by :meth:`Device.plan_copy
        <kvhal.device.Device.plan_copy>` (or cut from one: :func:`~kvhal.copyplan.plan_by_layer`).

        :param after_compute: order the copy after the compute stream's work. ``False`` only
            right after a copy of the same ``kind`` that was, with nothing new on the compute
            stream since: the copies of one kind share a stream, and run in its order.
        :return: the job id.
        """
        keys = tuple(keys)
        if keys and len(keys) != plan.num_blocks:
            raise ValidationError("keys", f"{len(keys)} keys for {plan.num_blocks} block pairs")
        job = _Job(kind, keys, plan)
        if kind not in self._streams:
            self._streams[kind] = self.device.create_stream()
        stream = self._streams[kind]
        try:
            job.event = self.device.submit(plan, stream, after_compute=after_compute)
        except KVHALError as exc:  # a device failure: reported as a failed job...
            job.error = f"submission failed: {exc}"
            # ...once whatever part of the copy was queued has finished writing,
            # so that a caller recomputing the blocks cannot race those writes
            job.event = self.device.create_event()
            self.device.record_event(job.event, stream)
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = job
        return job_id

    def _finish(self, job_id: int, error: str | None) -> TransferResult:
        job = self._jobs.pop(job_id)
        failed = () if error is None else tuple(job.plan.dst_ids.tolist())
        result = TransferResult(job_id, job.kind, error is None, job.keys, failed, error)
        if self.listener is not None:
            self.listener(result)
        return result

    def _outcome(self, job: _Job, block: bool) -> tuple[bool, str | None]:
        """(finished, error) of a job; blocks until it finishes when ``block``."""
        if job.error is not None:
            try:
                if block:
                    self.device.synchronize_event(job.event)
                elif not self.device.query_event(job.event):
                    return False, None
            except KVHALError:
                pass  # already failed; its error is the one reported
            return True, job.error
        try:
            if block:
                self.device.synchronize_event(job.event)
                return True, None
            return self.device.query_event(job.event), None
        except KVHALError as exc:  # TransferError, or a plugin breaking its contract
            return True, str(exc)

    def fence(self, stream: Any, job_ids: Iterable[int] | None = None) -> int:
        """Make work submitted to ``stream`` from now on wait for pending stores.

        A block a store still reads must not be rewritten: an engine fences its
        compute stream before a step that reuses blocks such a store reads.
        Without blocking the caller where the device has real streams.

        :param job_ids: the store jobs to wait for (default: every pending store);
            ids no longer pending finished already and are skipped, as are loads.
        :return: how many pending stores the stream now waits for.
        """
        if job_ids is None:
            jobs = list(self._jobs.values())
        else:
            jobs = [self._jobs[i] for i in dict.fromkeys(job_ids) if i in self._jobs]
        count = 0
        for job in jobs:
            if job.kind is TransferKind.STORE and job.event is not None:
                self.device.stream_wait_event(stream, job.event)
                count += 1
        return count

    def order_after(self, stream: Any, job_ids: Iterable[int]) -> int:
        """Make work submitted to ``stream`` from now on wait for the jobs ``job_ids``
        (loads or stores): a forward that reads the blocks a load writes. Without blocking
        the caller where the device has real streams; ids no longer pending are skipped.

        :return: how many pending jobs the stream now waits for.
        """
        jobs = [self._jobs[i] for i in dict.fromkeys(job_ids) if i in self._jobs]
        for job in jobs:
            self.device.stream_wait_event(stream, job.event)
        return len(jobs)

    def poll(self) -> list[TransferResult]:
        """The jobs finished since the last call, in submission order, without blocking."""
        results = []
        for job_id, job in list(self._jobs.items()):
            finished, error = self._outcome(job, block=False)
            if finished:
                results.append(self._finish(job_id, error))
        return results

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferResult]:
        """Block until ``job_ids`` (default: every pending job) finish; their results.

        :raises ValidationError: a job id is unknown or was already reported
            (checked before waiting).
        """
        ids = list(self._jobs) if job_ids is None else list(job_ids)
        unknown = [job_id for job_id in ids if job_id not in self._jobs]
        if unknown:
            raise ValidationError("job_ids", f"not pending (unknown or already reported): {unknown[:8]}")
        results = []
        for job_id in dict.fromkeys(ids):
            _, error = self._outcome(self._jobs[job_id], block=True)
            results.append(self._finish(job_id, error))
        return results
