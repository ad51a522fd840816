"""Pinned host buffers: anonymous memory registered with the device before it is handed out.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host
allocator, which rounds every request up to a power of two (vLLM notes
100 GB becoming 128 GB, ``cuda_mem_ops.pin_tensor``). Instead a buffer is an
anonymous ``mmap`` (page-aligned, zero-filled by the kernel: no memset on the
start-up path) registered with ``cudaHostRegister``/``hipHostRegister``.

- **Registration finishes before** :meth:`HostRegistrar.allocate` **returns**
  (``KVHAL_PIN_HOST=sync``, the default; ``off`` leaves buffers pageable).
  vLLM 0.32 registers its KV caches with the connector, which allocates the
  host tier, and only then captures CUDA graphs, in global capture mode where
  a runtime call from any thread breaks the capture (vLLM #46933, #48053). A
  background registration could still be running then (vLLM tried it in
  #45850 and reverted it in #46958); one that has finished cannot.
- **Chunks of at most** :data:`MAX_REGISTER_CHUNK` (64 GiB): one registration
  of 512 GiB or more fails on recent NVIDIA drivers (vLLM #51080; vLLM 0.32's
  ``pin_mmap_region`` chunks the same way). Chunks end on page boundaries, so
  the driver's page rounding never makes two overlap. A copy whose host range
  spans two registrations is rejected by ``cudaMemcpyBatchAsync`` (sglang
  #36798), and kvhal coalesces runs of consecutive slots into one descriptor,
  so ending chunks on slot boundaries (vLLM's choice) would not prevent it:
  instead copies are cut at the chunk boundaries (:meth:`HostRegistrar.boundaries`,
  applied by :class:`kvhal.accel.copies.EngineCopyHooks`). Registration is all
  or nothing: a failing chunk unregisters the ones before it and the buffer
  stays pageable (copies stay correct, only slower).
- **Freeing drains the device first, whatever the pin state**: a copy enqueued
  with ``srcAccessOrder=ANY`` may read its source after the API call returned,
  pageable or not (cuda-python's ``memcpy_batch_async`` documentation).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvhal.accel.host_buffers import PAGE, PinMode, map_zeroed, round_to_pages

log = logging.getLogger(__name__)

#: The largest single registration (vLLM 0.32 ``MAX_HOST_REGISTER_CHUNK_BYTES``).
MAX_REGISTER_CHUNK = 64 << 30


def registration_chunks(
    nbytes: int, granule: int = PAGE, max_chunk: int = MAX_REGISTER_CHUNK
) -> list[tuple[int, int]]:
    """``(offset, size)`` pieces covering ``[0, nbytes)``, registered one call each.

    Every piece but the last is the same whole number of ``lcm(granule, PAGE)``
    units, as many as fit in ``max_chunk`` (at least one: a unit larger than
    ``max_chunk`` is registered whole, as vLLM does with a row larger than its
    cap); so each piece ends on a page boundary and on a ``granule`` boundary
    (a slot size, where the caller knows one).

    :raises ValueError: a size or granule is not positive.
    """
    if nbytes <= 0 or granule <= 0 or max_chunk <= 0:
        raise ValueError(
            f"nbytes, granule and max_chunk must be positive, got {nbytes}, {granule}, {max_chunk}"
        )
    unit = math.lcm(granule, PAGE)
    step = max(max_chunk // unit, 1) * unit
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


#: ``register(address, nbytes) -> error code`` and ``unregister(address) -> error code``.
Register = Callable[[int, int], int]
Unregister = Callable[[int], int]


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    nbytes: int
    #: Addresses of the registered chunks (all of them, or none).
    registered: list[int] = field(default_factory=list)


class HostRegistrar:
    """Allocates host buffers and registers them with the device (see the module docstring).

    :param register: page-locks ``[address, address + nbytes)``; returns 0 on
        success (and leaves no pending runtime error either way).
    :param unregister: undoes one ``register`` of ``address``; returns 0 on success.
    :param mode: :class:`PinMode`.
    :param before_unregister: called before a buffer is released, to drain
        copies that may still read it (a device synchronize).
    :param max_chunk: the largest single registration.
    """

    def __init__(
        self,
        register: Register,
        unregister: Unregister,
        mode: PinMode = PinMode.SYNC,
        before_unregister: Callable[[], None] | None = None,
        max_chunk: int = MAX_REGISTER_CHUNK,
    ) -> None:
        self._register, self._unregister = register, unregister
        self.mode = mode
        self._before_unregister = before_unregister
        self.max_chunk = max_chunk
        self._buffers: dict[int, _Buffer] = {}
        self._lock = threading.Lock()
        self._boundaries = np.zeros(0, dtype=np.int64)
        # A buffer never freed is unmapped when the registrar goes (its records hold the
        # mappings): unregister it first, or the driver keeps the range registered, the pages
        # stay locked, and the next mapping at that address fails with "already registered"
        # (error 712, seen on an H200 where each test built its own plugin).
        self._finalizer = weakref.finalize(
            self, _release_leftovers, self._buffers, unregister, before_unregister
        )

    def _pin(self, address: int, nbytes: int) -> list[int]:
        """Register every chunk, or none: the registered addresses."""
        done: list[int] = []
        for offset, size in registration_chunks(nbytes, PAGE, self.max_chunk):
            code = int(self._register(address + offset, size))
            if code == 0:
                done.append(address + offset)
                continue
            log.warning(
                "kvhal: registering host memory failed (error %d) for the chunk of %d bytes at offset %d "
                "of a %d-byte buffer; %d chunk(s) before it unregistered, the buffer stays pageable "
                "(copies stay correct, only slower)",
                code,
                size,
                offset,
                nbytes,
                len(done),
            )
            self._release(reversed(done))
            return []
        return done

    def _release(self, addresses: Iterable[int]) -> None:
        _unregister_all(self._unregister, addresses)

    def _update_boundaries(self) -> None:
        # Where two registrations of one buffer meet: no copy descriptor may span one.
        with self._lock:
            points = [a for record in self._buffers.values() for a in record.registered[1:]]
            self._boundaries = np.array(sorted(points), dtype=np.int64)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed, page-aligned buffer of ``nbytes``, registered on return unless the mode is ``off``."""
        tensor = map_zeroed(nbytes)
        address, size = tensor.data_ptr(), round_to_pages(nbytes)
        registered = self._pin(address, size) if self.mode is PinMode.SYNC else []
        with self._lock:
            self._buffers[address] = _Buffer(tensor, size, registered)
        if len(registered) > 1:
            self._update_boundaries()
        return tensor

    def owns(self, buffer: torch.Tensor) -> bool:
        with self._lock:
            return buffer.data_ptr() in self._buffers

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """For its own buffers, whether every chunk is registered;
        for any other buffer, what torch says (``Tensor.is_pinned()``)."""
        with self._lock:
            record = self._buffers.get(buffer.data_ptr())
        if record is None:
            return bool(buffer.is_pinned())
        return bool(record.registered)

    def wait(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is pinned (registration has always finished by now)."""
        return self.is_pinned(buffer)

    def boundaries(self) -> np.ndarray:
        """Sorted host addresses where two registrations of one live buffer meet."""
        return self._boundaries

    def free(self, buffer: torch.Tensor) -> None:
        """Drain the device, then unregister ``buffer``'s chunks; its memory is unmapped
        when the last tensor viewing it is dropped. A buffer it does not own, or one
        already freed, is left alone."""
        with self._lock:
            record = self._buffers.pop(buffer.data_ptr(), None)
        if record is None:
            return
        # Pinned or not: an ANY-order copy may still read the buffer after its call returned.
        if self._before_unregister is not None:
            self._before_unregister()
        self._release(record.registered)
        if len(record.registered) > 1:
            self._update_boundaries()


def _unregister_all(unregister: Unregister, addresses: Iterable[int]) -> None:
    for address in addresses:
        code = int(unregister(address))
        if code != 0:
            log.warning("kvhal: unregistering host memory at %#x failed (error %d)", address, code)


def _release_leftovers(
    buffers: dict[int, _Buffer], unregister: Unregister, before_unregister: Callable[[], None] | None
) -> None:
    """The registrar's finalizer: unregister every buffer it still holds, before the
    mappings can go (the dict is the last owner of the records)."""
    leftovers = [record for record in buffers.values() if record.registered]
    if not leftovers:
        return
    try:
        if before_unregister is not None:
            before_unregister()
        for record in leftovers:
            _unregister_all(unregister, record.registered)
            record.registered = []
    except Exception:  # a finalizer must not raise (it may run at interpreter exit)
        log.warning("kvhal: unregistering leftover host buffers failed", exc_info=True)
