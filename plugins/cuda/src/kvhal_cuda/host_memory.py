"""Pinned host buffers: anonymous memory registered with the device, off the critical path.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host
allocator, which rounds every request up to a power of two (vLLM notes
100 GB becoming 128 GB, ``cuda_mem_ops.pin_tensor``). Instead a buffer is an
anonymous ``mmap`` (page-aligned, zero-filled by the kernel: no memset on the
start-up path) registered with ``cudaHostRegister``/``hipHostRegister``. Page
locking a large buffer takes seconds, so by default it runs on a background
thread (vLLM #45850); until it has finished, :meth:`HostRegistrar.is_pinned`
says ``False`` and copies treat the buffer as pageable memory (the runtime
documents staged copies for ``cudaMemcpyAsync``; for ``cuMemcpyBatchAsync``
racing a registration this is assumed, not yet run on a GPU). Registration
pins pages in place and moves no data. ``sync`` removes the window.

``KVHAL_PIN_HOST=async`` (default), ``sync`` (register before returning) or
``off`` (pageable buffers).
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvhal.accel.host_buffers import PinMode

log = logging.getLogger(__name__)

PAGE = 4096


def map_zeroed(nbytes: int) -> torch.Tensor:
    """A page-aligned, zero-filled flat ``int8`` CPU tensor of ``nbytes`` over an anonymous mmap.

    The mapping lives as long as the tensor (or any view of it).
    """
    size = (nbytes + PAGE - 1) // PAGE * PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.int8, count=nbytes)


#: ``register(address, nbytes) -> error code`` and ``unregister(address) -> error code``.
Register = Callable[[int, int], int]
Unregister = Callable[[int], int]


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    nbytes: int
    registration: Future | None


class HostRegistrar:
    """Allocates host buffers and registers them with the device (see the module docstring).

    :param register: page-locks ``[address, address + nbytes)``; returns 0 on success.
    :param unregister: undoes ``register``; returns 0 on success.
    :param mode: :class:`PinMode`.
    :param before_unregister: called before a buffer is unregistered, to drain
        copies that may still use it (a device synchronize).
    """

    def __init__(
        self,
        register: Register,
        unregister: Unregister,
        mode: PinMode = PinMode.ASYNC,
        before_unregister: Callable[[], None] | None = None,
    ) -> None:
        self._register, self._unregister = register, unregister
        self.mode = mode
        self._before_unregister = before_unregister
        self._buffers: dict[int, _Buffer] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvhal-host-register")
        return self._pool

    def _pin(self, address: int, nbytes: int) -> bool:
        code = int(self._register(address, nbytes))
        if code != 0:
            log.warning(
                "kvhal: registering %d bytes of host memory failed (error %d); "
                "copies stay correct but use pageable memory",
                nbytes,
                code,
            )
        return code == 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed, page-aligned buffer of ``nbytes``, registered now, later, or never (by mode)."""
        tensor = map_zeroed(nbytes)
        address, size = tensor.data_ptr(), (nbytes + PAGE - 1) // PAGE * PAGE
        registration: Future | None = None
        if self.mode is PinMode.SYNC:
            registration = Future()
            registration.set_result(self._pin(address, size))
        elif self.mode is PinMode.ASYNC:
            registration = self._executor().submit(self._pin, address, size)
        with self._lock:
            self._buffers[address] = _Buffer(tensor, size, registration)
        return tensor

    def owns(self, buffer: torch.Tensor) -> bool:
        with self._lock:
            return buffer.data_ptr() in self._buffers

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """For its own buffers, ``True`` once registration has finished and succeeded;
        for any other buffer, what torch says (``Tensor.is_pinned()``)."""
        with self._lock:
            record = self._buffers.get(buffer.data_ptr())
        if record is None:
            return bool(buffer.is_pinned())
        if record.registration is None or not record.registration.done():
            return False
        return (
            not record.registration.cancelled()
            and record.registration.exception() is None
            and bool(record.registration.result())
        )

    def wait(self, buffer: torch.Tensor) -> bool:
        """Block until ``buffer``'s registration has finished; whether it is pinned."""
        with self._lock:
            record = self._buffers.get(buffer.data_ptr())
        if record is not None and record.registration is not None:
            try:
                record.registration.result()
            except Exception:
                return False
        return self.is_pinned(buffer)

    def free(self, buffer: torch.Tensor) -> None:
        """Unregister ``buffer`` (after its registration, if one is running, finishes).

        Its memory is unmapped when the last tensor viewing it is dropped.
        """
        with self._lock:
            record = self._buffers.pop(buffer.data_ptr(), None)
        if record is None or record.registration is None:
            return
        if record.registration.cancel():
            return
        try:
            pinned = record.registration.result()
        except Exception:
            pinned = False
        if not pinned:
            return
        if self._before_unregister is not None:
            self._before_unregister()
        code = int(self._unregister(record.tensor.data_ptr()))
        if code != 0:
            log.warning("kvhal: unregistering host memory failed (error %d)", code)
