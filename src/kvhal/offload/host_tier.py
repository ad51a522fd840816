"""The host tier: equal slots in one pinned host buffer, and their free list.

:class:`SlotPool` is the free list, the one source of truth for which slots
are taken. In one process the :class:`~kvhal.offload.manager.OffloadingManager` and
the :class:`HostTier` share it (pass ``tier.pool`` to the manager); when vLLM
runs the manager in the scheduler process and the copies in a worker, the
manager's pool decides and the worker's tier only holds the bytes.

Slots have one size, so churn cannot fragment the tier: any ``n`` free slots
serve an allocation of ``n``, and the pool's memory never grows. Freed runs
are handed out again in ascending order, which keeps a copy's descriptors
coalesced (:mod:`kvhal.copyplan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvhal.cache import DEFAULT_ALIGNMENT, KVCache, dense_kv_cache
from kvhal.errors import ClosedError, ValidationError, check_int
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout

if TYPE_CHECKING:
    import torch

    from kvhal.device import Device


class SlotPool:
    """A free list over ``num_slots`` equal slots: O(1) per slot; a double free is an error.

    :attr:`ids` holds one int object per slot, and every slot id handed out
    is that object: the manager's index and its policy's lists share them
    instead of each allocating their own (36 bytes a slot, once).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_int("num_slots", num_slots)
        self.ids: tuple[int, ...] = tuple(range(num_slots))
        self._free = list(reversed(self.ids))  # popped from the end: 0, 1, 2, ...
        self._taken = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slot ids (ascending where the free list allows), or ``None`` if fewer are free."""
        check_int("n", n, minimum=0)
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        taken = self._taken
        for slot in ids:
            taken[slot] = 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return slots; all are checked (in range, taken, not repeated) before any is freed."""
        ids = list(ids)
        taken = self._taken
        seen = set()
        not_a_slot = f"slot {{value!r}} is not in [0, {self.num_slots})"
        for slot in ids:
            check_int("ids", slot, minimum=0, below=self.num_slots, message=not_a_slot)
            if not taken[slot] or slot in seen:
                raise ValidationError("ids", f"slot {slot} is already free (double free)")
            seen.add(slot)
        self._release(ids)

    def _release(self, ids: list[int]) -> None:
        """Free ``ids`` known to be taken and distinct (the manager's checked victims)."""
        taken, canonical = self._taken, self.ids
        for slot in ids:
            taken[slot] = 0
        # Descending, so that the next allocation pops a freed run in ascending order.
        self._free.extend([canonical[slot] for slot in sorted(ids, reverse=True)])

    def is_free(self, slot: int) -> bool:
        return not self._taken[slot]

    def are_taken(self, ids: Iterable[int]) -> bool:
        """Whether every slot in ``ids`` (each in range) is allocated."""
        return all(map(self._taken.__getitem__, ids))


class HostTier:
    """One pinned host buffer from the device plugin, cut into ``slot_bytes`` slots.

    :param device: the device whose plugin allocates (pins) the buffer.
    :param capacity_bytes: the tier's size; rounded down to whole slots.
    :param slot_bytes: one offloaded block of one KV cache group
        (``geometry.block_bytes``); every group offloaded here has this size.

    The buffer is ``num_slots * slot_bytes`` plus :data:`~kvhal.cache.DEFAULT_ALIGNMENT`
    bytes, the slack a SPLIT (K, V) view needs to align its second part.
    """

    def __init__(self, device: Device, capacity_bytes: int, slot_bytes: int) -> None:
        check_int("capacity_bytes", capacity_bytes)
        self.slot_bytes = check_int("slot_bytes", slot_bytes)
        if capacity_bytes < slot_bytes:
            raise ValidationError(
                "capacity_bytes", f"{capacity_bytes} bytes cannot hold one slot of {slot_bytes} bytes"
            )
        self.num_slots = capacity_bytes // slot_bytes
        self.device = device
        self.pool = SlotPool(self.num_slots)
        self.buffer: torch.Tensor | None = device.allocate_host_buffer(
            self.num_slots * slot_bytes + DEFAULT_ALIGNMENT
        )
        self._views: dict[tuple, KVCache] = {}
        self._footprint: tuple | None = None

    @classmethod
    def for_geometry(cls, device: Device, geometry: KVGeometry, capacity_bytes: int) -> HostTier:
        """A tier whose slots hold one block of ``geometry``."""
        return cls(device, capacity_bytes, geometry.block_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def is_pinned(self) -> bool:
        return self.device.host_buffer_is_pinned(self._buffer())

    def _buffer(self) -> torch.Tensor:
        if self.buffer is None:
            raise ClosedError("host tier")
        return self.buffer

    def view(self, geometry: KVGeometry, layout: KVLayout) -> KVCache:
        """A host :class:`KVCache` over the tier in ``layout``: slot ``i`` is its block ``i``.

        Copy between it and a device cache of the same geometry and layout.
        Views for several KV cache groups share the slots, so each must put
        slot ``i`` on the same bytes: the first view fixes that footprint and
        a view that differs is refused (a cross-layer layout, or groups of
        equal layer count and page size, always agree).
        """
        if not isinstance(geometry, KVGeometry):
            raise ValidationError("geometry", f"must be a KVGeometry, got {type(geometry).__name__}")
        if geometry.block_bytes != self.slot_bytes:
            raise ValidationError(
                "geometry", f"one block is {geometry.block_bytes} bytes; the tier's slots {self.slot_bytes}"
            )
        key = (geometry.with_num_blocks(1), layout.stride_order)
        if key not in self._views:
            buffer = self._buffer()
            cache = dense_kv_cache(geometry.with_num_blocks(self.num_slots), layout, buffer)
            base = buffer.data_ptr()
            footprint = tuple((f.address - base, f.length, f.block_stride) for f in cache.segments.merged)
            if self._footprint is None:
                self._footprint = footprint
            elif footprint != self._footprint:
                raise ValidationError(
                    "layout",
                    f"{layout} of {geometry} puts a slot on other bytes than the tier's first view; "
                    "use a cross-layer layout, or groups of equal layers and page size",
                )
            self._views[key] = cache
        return self._views[key]

    # -- slot bytes, for the tiers below ------------------------------------------

    def _runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(offset, length, stride)`` of the runs that make up slot 0 (slot ``i``: ``+ i * stride``)."""
        if self._footprint is None:  # no view yet: the slot is the buffer's i-th slot_bytes
            return ((0, self.slot_bytes, self.slot_bytes),)
        return self._footprint

    @property
    def slots_are_contiguous(self) -> bool:
        """Whether each slot's bytes are one run (then :meth:`slot_memory` is zero-copy)."""
        return len(self._runs()) == 1

    def slot_memory(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes in place; only where :attr:`slots_are_contiguous`."""
        check_int("slot", slot, minimum=0, below=self.num_slots)
        if not self.slots_are_contiguous:
            raise ValidationError("slot", "this tier's slots are scattered; use gather_slots/scatter_slots")
        offset, length, stride = self._runs()[0]
        start = offset + slot * stride
        return memoryview(self._bytes()[start : start + length])

    def memory(self) -> memoryview:
        """The whole buffer's bytes in place (every slot lies in it)."""
        return memoryview(self._bytes())

    def _bytes(self) -> np.ndarray:
        return self._buffer().numpy()

    def _run_views(self) -> list[tuple[int, np.ndarray]]:
        """Per run: its position inside a slot's bytes, and a ``[num_slots, length]`` view of it."""
        data, views, position = self._bytes(), [], 0
        for offset, length, stride in self._runs():
            view = np.lib.stride_tricks.as_strided(
                data[offset:], shape=(self.num_slots, length), strides=(stride, 1), writeable=True
            )
            views.append((position, view))
            position += length
        return views

    def gather_slots(self, slots: Sequence[int], out: np.ndarray) -> None:
        """Copy slots ``slots`` into the rows of ``out`` (``[len(slots), slot_bytes]`` bytes),
        each slot's runs one after the other."""
        index = np.asarray(slots, dtype=np.int64)
        for position, view in self._run_views():
            out[:, position : position + view.shape[1]] = view[index]

    def scatter_slots(self, slots: Sequence[int], rows: np.ndarray) -> None:
        """The inverse of :meth:`gather_slots`: write ``rows`` into slots ``slots``."""
        index = np.asarray(slots, dtype=np.int64)
        for position, view in self._run_views():
            view[index] = rows[:, position : position + view.shape[1]]

    def allocate(self, n: int) -> list[int] | None:
        """See :meth:`SlotPool.allocate`."""
        return self.pool.allocate(n)

    def free(self, ids: Iterable[int]) -> None:
        """See :meth:`SlotPool.free`."""
        self.pool.free(ids)

    def close(self) -> None:
        """Drop the views and free the buffer through the device (idempotent)."""
        if self.buffer is None:
            return
        self._views.clear()
        buffer, self.buffer = self.buffer, None
        self.device.free_host_buffer(buffer)

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
