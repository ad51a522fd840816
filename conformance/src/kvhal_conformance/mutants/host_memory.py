"""Mutants of host memory: sizes, alignment, pinning, recycling."""

from __future__ import annotations

import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvhal.cpu import CPUPlugin, memory
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.hookspecs import hookimpl
from kvhal_conformance.mutants.registry import (
    LARGE,
    _replace_caps,
    mutant,
)


@mutant("host.buffer")
class BuffersRoundedDownTo64(CPUPlugin):
    """Hands out host buffers of ``nbytes & ~63`` bytes (an allocator granularity applied the
    wrong way): odd sizes come back short."""

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return super().kvhal_allocate_host_buffer(nbytes)[: nbytes & ~63]


@mutant("host.aligned")
class MisalignedLargeBuffers(CPUPlugin):
    """Host buffers of 1 MiB or more start 64 bytes into a page (an allocator aligning to 64)."""

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes < 1 << 20:
            return super().kvhal_allocate_host_buffer(nbytes)
        return super().kvhal_allocate_host_buffer(nbytes + 64)[64:]


class RecyclesFreedBuffers(CPUPlugin):
    """Keeps freed host buffers of at least ``recycle_bytes`` and hands them out again,
    uncleared, for the same size (a base of defects, not a mutant itself)."""

    recycle_bytes = 0

    def __init__(self) -> None:
        super().__init__()
        self._freed: dict[int, list[torch.Tensor]] = {}

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        pool = self._freed.get(nbytes)
        return pool.pop() if pool else super().kvhal_allocate_host_buffer(nbytes)

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() >= self.recycle_bytes:
            self._freed.setdefault(buffer.numel(), []).append(buffer)
        else:
            super().kvhal_free_host_buffer(buffer)


@mutant("host.zeroed")
class RecyclesLargeBuffersDirty(RecyclesFreedBuffers):
    """Keeps freed host buffers of 8 MiB or more and hands them out again, uncleared, for the
    same size (a cache for host tiers)."""

    recycle_bytes = LARGE


@mutant("host.distinct")
class SlabRoundsDown(CPUPlugin):
    """Carves host buffers under 1 MiB from a locked slab, advancing by the size rounded
    *down* to pages: a buffer's odd tail is the next buffer's head."""

    SLAB = 64 << 20

    def __init__(self) -> None:
        super().__init__()
        self._slab: torch.Tensor | None = None
        self._offset = 0
        self._lock = threading.Lock()

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes >= 1 << 20:
            return super().kvhal_allocate_host_buffer(nbytes)
        with self._lock:
            if self._slab is None or self._offset + nbytes + 4096 > self.SLAB:
                self._slab, self._offset = memory.allocate(self.SLAB, self.lock_policy()), 0
            buffer = self._slab[self._offset : self._offset + nbytes]
            self._offset += nbytes // 4096 * 4096
        buffer.zero_()
        return buffer

    def _in_slab(self, buffer: torch.Tensor) -> bool:
        slab = self._slab
        return slab is not None and slab.data_ptr() <= buffer.data_ptr() < slab.data_ptr() + slab.numel()

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if not self._in_slab(buffer):
            super().kvhal_free_host_buffer(buffer)

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        if self._in_slab(buffer):
            return self.lock_policy().lock
        return super().kvhal_host_buffer_is_pinned(buffer)


@mutant("host.pinned")
class NeverPins(CPUPlugin):
    """Declares ``host.pinned`` but never locks a buffer (the locking call was left out)."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={Capability.PINNED_HOST.value})

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return memory.allocate(nbytes, memory.LockPolicy(False, "the locking call was left out"))


@mutant("free.release")
class FreeRefusesOddSizes(CPUPlugin):
    """Unlocks with a page-multiple size check: freeing a buffer of an odd size raises."""

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() % memory.PAGE:
            raise ValueError(f"cannot unlock {buffer.numel()} bytes: not a multiple of the page size")
        super().kvhal_free_host_buffer(buffer)


@mutant("pinned.bool")
class PinnedAnswersInt(CPUPlugin):
    """Answers the driver's int (1 or 0) instead of a bool."""

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> int:
        return int(memory.is_locked(buffer))


@mutant("pinned.truthful")
class PinnedLiar(CPUPlugin):
    """kvhal_host_buffer_is_pinned answers True for any tensor."""

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        return True


class BooksUnlockedAsPinned(CPUPlugin):
    """Declares ``host.pinned`` and locks buffers under ``pin_below`` bytes; larger ones stay
    pageable but are booked as locked, so ``kvhal_host_buffer_is_pinned`` says True (a base of
    defects, not a mutant itself)."""

    pin_below = 0

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={Capability.PINNED_HOST.value})

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        # where this process may not lock, every buffer is only booked: the defect stays the same
        if nbytes < self.pin_below and self.lock_policy().lock:
            return memory.allocate(nbytes, self.lock_policy())
        buffer = memory.allocate(nbytes, memory.LockPolicy(False, "the lock was skipped"))
        with memory._lock:  # the plugin's own bookkeeping, which the pinned query reads
            memory._locked[buffer.data_ptr()] = (nbytes, StorageWeakRef(buffer.untyped_storage()))
        return buffer


@mutant("pinned.witness")
class PinsNothingSaysPinned(BooksUnlockedAsPinned):
    """Declares ``host.pinned`` and books every buffer as locked, but the locking call was left
    out: ``kvhal_host_buffer_is_pinned`` says True for memory nobody pinned."""


@mutant("pinned.witness")
class PinsOnlyUnder256MiB(BooksUnlockedAsPinned):
    """Locks host buffers from a pinned pool of 256 MiB; larger ones come from pageable memory
    and are booked as locked all the same."""

    pin_below = 256 << 20


@mutant("pinned.witness", sizes="quick")
class PinsOnlyUnder2GiB(BooksUnlockedAsPinned):
    """Passes the size to the locking call as a 32-bit int: buffers of 2 GiB or more are not
    locked (the call's error ignored) and are booked as locked all the same.

    The tiny preset's largest witnessed buffer is 257 MiB: this mutant runs with the quick
    preset (2112 MiB, where the machine has 4 times that available)."""

    pin_below = 2 << 30
