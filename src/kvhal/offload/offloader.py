"""Single-process wiring: a manager, a host tier and a transfer engine over the KV caches.

With vLLM multiprocessing the manager lives in the scheduler and the engine
in the worker, and a connector carries the job results between them; in one
process :class:`Offloader` does that: it turns keys and device block ids
into jobs, and applies every finished job to the manager
(``complete_store(success)``, ``complete_load``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhal.cache import KVCache
from kvhal.errors import ValidationError, check_int
from kvhal.offload.host_tier import HostTier
from kvhal.offload.manager import OffloadingManager
from kvhal.offload.transfer import TransferEngine, TransferKind, TransferResult


@dataclass(frozen=True)
class StoreJob:
    """A store :meth:`Offloader.store` started.

    :param job_id: the engine's job, or ``None`` when every key was present already.
    :param keys: the keys being stored (the others were present).
    :param evicted: keys evicted to make room.
    """

    job_id: int | None
    keys: list[bytes]
    evicted: list[bytes]


def _check_block_ids(block_ids: Sequence[int], keys: Sequence[bytes], cache: KVCache) -> list[int]:
    ids = list(block_ids)
    if len(ids) != len(keys):
        raise ValidationError("block_ids", f"{len(ids)} block ids for {len(keys)} keys")
    not_a_block = f"{{value!r}} is not a block id in [0, {cache.num_blocks})"
    for block in ids:
        check_int("block_ids", block, minimum=0, below=cache.num_blocks, message=not_a_block)
    if len(set(ids)) != len(ids):
        raise ValidationError("block_ids", "a device block is listed twice")
    return ids


class Offloader:
    """Stores device blocks into the host tier and loads them back, keeping the manager current.

    :param manager: allocates from ``host_tier.pool`` (one free list).
    :param caches: the device KV cache of each KV cache group, by group index;
        each group's host view is ``host_tier.view(cache.geometry, cache.layout)``.
    """

    def __init__(
        self,
        manager: OffloadingManager,
        engine: TransferEngine,
        host_tier: HostTier,
        caches: Sequence[KVCache],
    ) -> None:
        if manager.pool is not host_tier.pool:
            raise ValidationError("manager", "must allocate from host_tier.pool (one source of truth)")
        self.manager = manager
        self.engine = engine
        self.host_tier = host_tier
        self.caches = list(caches)
        self.views = [host_tier.view(cache.geometry, cache.layout) for cache in self.caches]

    def _group(self, group: int) -> int:
        groups = len(self.caches)
        message = f"{{value!r}} is not a KV cache group in [0, {groups})"
        return check_int("group", group, minimum=0, below=groups, message=message)

    def store(self, group: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> StoreJob | None:
        """Offload device blocks ``block_ids`` of ``group`` under ``keys``.

        Everything is checked before the manager changes. Keys already
        offloaded are skipped.

        :return: the job, or ``None`` if the manager could not make room.
        """
        cache = self.caches[self._group(group)]
        keys = list(keys)
        ids = _check_block_ids(block_ids, keys, cache)
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
        if not plan.keys:
            return StoreJob(None, [], plan.evicted)
        block_of = dict(zip(keys, ids, strict=True))
        mapping = [(block_of[key], slot) for key, slot in zip(plan.keys, plan.slots, strict=True)]
        try:
            job_id = self.engine.submit_store(plan.keys, cache, self.views[group], mapping)
        except BaseException:
            self.manager.complete_store(plan.keys, success=False)
            raise
        return StoreJob(job_id, plan.keys, plan.evicted)

    def load(self, group: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Load ready ``keys`` into device blocks ``block_ids`` of ``group``; the job id.

        :raises BlockStateError: a key is not ready (nothing changed).
        """
        cache = self.caches[self._group(group)]
        keys = list(keys)
        ids = _check_block_ids(block_ids, keys, cache)
        slots = self.manager.prepare_load(keys)
        try:
            return self.engine.submit_load(keys, self.views[group], cache, list(zip(slots, ids, strict=True)))
        except BaseException:
            self.manager.complete_load(keys)
            raise

    def _apply(self, results: list[TransferResult]) -> list[TransferResult]:
        for result in results:
            if not result.keys:
                continue
            if result.kind is TransferKind.STORE:
                self.manager.complete_store(result.keys, success=result.success)
            else:
                self.manager.complete_load(result.keys)
        return results

    def poll(self) -> list[TransferResult]:
        """Finished jobs, applied to the manager. A failed load's ``failed_block_ids``
        are the device blocks to recompute."""
        return self._apply(self.engine.poll())

    def wait(self, job_ids: Sequence[int] | None = None) -> list[TransferResult]:
        """Like :meth:`poll`, blocking until ``job_ids`` (default: all) finish."""
        return self._apply(self.engine.wait(job_ids))
