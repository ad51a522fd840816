"""Host buffers on Ascend: exact-size memory page-locked through AscendCL (``libascendcl.so``).

``torch.zeros(n, pin_memory=True)`` goes through torch_npu's caching host
allocator, which rounds every request up to a power of two (a 100 GB tier
pins 128 GB). Instead each buffer is page-locked by the first of these
AscendCL routes that is present and succeeds (:func:`choose_pin_routes`):

``aclrtMallocHost``
    ``aclrtMallocHost(&p, size)`` for the exact size plus one page (the
    runtime aligns to 64 bytes only; the buffer is sliced to 4 KiB): the
    driver-pinned memory torch_npu's allocator itself hands out, without the
    rounding. The runtime does not initialise it, so it is zeroed here with
    torch's multi-threaded fill (pinning any memory faults in, and so zeroes,
    every page anyway). ``aclrtFreeHost`` releases it once
    :meth:`PinnedHostBuffers.free` has run and the last view is gone.
``aclrtHostRegisterV2``
    where ``aclrtMallocHost`` fails (its pinned pool exhausted) or is missing:
    an anonymous ``mmap`` (page-aligned, zero-filled by the kernel) registered
    with ``aclrtHostRegisterV2(ptr, size, ACL_HOST_REG_PINNED)``, which
    page-locks memory from malloc or mmap (CANN 8.5+ runtime docs,
    ``aclcppdevg_03_2128``; Atlas A2/A3). The docs require a 4 KiB-aligned
    address and an OS kernel newer than 5.10 ("on 5.10 or lower, non-page-locked
    memory causes exceptions"). It is second because a third-party measurement
    saw registered 4 KiB-page memory copy at about a quarter of the bandwidth of
    torch_npu's pinned memory through ``swap_blocks_batch``.

``aclrtHostRegister(ptr, size, ACL_HOST_REGISTER_MAPPED, &devPtr)``, which
vllm-ascend's ``kv_offload/shmem_host.py`` calls on ``aclrtMallocHost``
memory, maps host memory for device access; its docs say the mapped address
"cannot be used for memory copies", so it is not used here.

Pinning is synchronous in every ``KVHAL_PIN_HOST`` mode but ``off``: a call
on a background thread could overlap the engine's graph capture, and the
AscendCL docs say nothing on that. A failed call logs a warning naming it and
its error code; when every route fails the buffer is pageable
(:meth:`PinnedHostBuffers.is_pinned` says ``False``) and copies stay correct.
Requests are not split into chunks: neither call documents a size limit.

By construction from the cited docs; not run on an Ascend NPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvhal.accel.host_buffers import PAGE, map_zeroed, round_to_pages
from kvhal.accel.native import bind, load_library

log = logging.getLogger(__name__)

LIBRARY = "libascendcl.so"
#: ``#define ACL_HOST_REG_PINNED 0x10000000UL`` (CANN runtime docs, ``aclrtHostRegisterV2``).
ACL_HOST_REG_PINNED = 0x10000000
REGISTER = "aclrtHostRegisterV2"
MALLOC_HOST = "aclrtMallocHost"
#: A few ``aclError`` codes (``typedef int aclError``; ``acl/error_codes/rt_error_codes.h``), for warnings.
ACL_ERRORS = {
    100000: "ACL_ERROR_INVALID_PARAM",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
}


def acl_error(code: int) -> str:
    """``code`` with its ``aclError`` name where known."""
    name = ACL_ERRORS.get(code)
    return f"{code} ({name})" if name else str(code)


@dataclass(frozen=True)
class AclHost:
    """The AscendCL host-memory calls, each ``None`` where the library lacks it.

    :param register_pinned: ``(ptr, size) -> aclError``: ``aclrtHostRegisterV2`` with ``ACL_HOST_REG_PINNED``.
    :param unregister: ``(ptr) -> aclError``: ``aclrtHostUnregister``.
    :param malloc_host: ``(size) -> (aclError, ptr)``: ``aclrtMallocHost``.
    :param free_host: ``(ptr) -> aclError``: ``aclrtFreeHost``.
    :param missing: why a call is ``None`` (library or symbol not found).
    """

    register_pinned: Callable[[int, int], int] | None = None
    unregister: Callable[[int], int] | None = None
    malloc_host: Callable[[int], tuple[int, int]] | None = None
    free_host: Callable[[int], int] | None = None
    missing: str = ""


def _symbol(lib: ctypes.CDLL, name: str, argtypes: list, missing: list[str]):
    try:
        return bind(lib, name, argtypes)  # aclError is int
    except AttributeError:
        missing.append(f"{LIBRARY} has no {name}")
        return None


@functools.cache
def load_acl(library: str = LIBRARY) -> AclHost:
    """The host-memory calls of the loaded AscendCL runtime (``torch_npu`` loads it first).

    Prototypes from the CANN runtime API reference:
    ``aclError aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag)``,
    ``aclError aclrtHostUnregister(void *ptr)``,
    ``aclError aclrtMallocHost(void **hostPtr, size_t size)``,
    ``aclError aclrtFreeHost(void *hostPtr)``.
    """
    lib, why = load_library(library)
    if lib is None:
        return AclHost(missing=why)
    missing: list[str] = []
    v2 = _symbol(lib, "aclrtHostRegisterV2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32], missing)
    unregister = _symbol(lib, "aclrtHostUnregister", [ctypes.c_void_p], missing)
    malloc = _symbol(lib, "aclrtMallocHost", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], missing)
    free = _symbol(lib, "aclrtFreeHost", [ctypes.c_void_p], missing)

    def malloc_host(size: int) -> tuple[int, int]:
        ptr = ctypes.c_void_p()
        code = malloc(ctypes.byref(ptr), size)
        return int(code), int(ptr.value or 0)

    return AclHost(
        register_pinned=(lambda ptr, size: int(v2(ptr, size, ACL_HOST_REG_PINNED))) if v2 else None,
        unregister=(lambda ptr: int(unregister(ptr))) if unregister else None,
        malloc_host=malloc_host if malloc else None,
        free_host=(lambda ptr: int(free(ptr))) if free else None,
        missing="; ".join(missing),
    )


def kernel_registers_pageable(release: str) -> bool:
    """Whether the AscendCL docs allow registering non-page-locked memory on kernel ``release``
    (newer than 5.10; an unreadable release counts as not)."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return match is not None and (int(match[1]), int(match[2])) > (5, 10)


def choose_pin_routes(acl: AclHost, kernel_release: str) -> tuple[tuple[str, ...], str]:
    """The ways host buffers can be page-locked here, in the order they are tried
    (:data:`MALLOC_HOST`, :data:`REGISTER`; empty: none), and a note saying what was left out and why."""
    routes: list[str] = []
    left_out: list[str] = []
    if acl.malloc_host and acl.free_host:
        routes.append(MALLOC_HOST)
    if acl.register_pinned and acl.unregister:
        if kernel_registers_pageable(kernel_release):
            routes.append(REGISTER)
        else:
            left_out.append(f"{REGISTER} not used: kernel {kernel_release} is 5.10 or older")
    if acl.missing:
        left_out.append(acl.missing)
    chosen = ", then ".join(routes) if routes else "no AscendCL pinning call"
    return tuple(routes), chosen + (f" ({'; '.join(left_out)})" if left_out else "")


def _free_host(free_host: Callable[[int], int], ptr: int) -> None:
    code = free_host(ptr)
    if code != 0:
        log.warning("kvhal-npu: aclrtFreeHost(%#x) failed with aclError %s", ptr, acl_error(code))


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    route: str | None
    pinned: bool


class PinnedHostBuffers:
    """Allocates host buffers, page-locks them through AscendCL, and releases them (module docstring).

    :param pin: whether to page-lock (``False`` for pageable buffers, ``KVHAL_PIN_HOST=off``).
    :param drain: called at the start of every :meth:`free` (a device synchronize), so no
        copy still uses the buffer when it is unregistered or released.
    :param acl: the AscendCL calls (loaded from ``libascendcl.so`` at the first pinned allocation by default).
    :param kernel_release: the OS kernel release (``os.uname().release`` by default).
    """

    def __init__(
        self,
        pin: bool = True,
        drain: Callable[[], None] | None = None,
        acl: AclHost | None = None,
        kernel_release: str | None = None,
    ) -> None:
        self.pin, self._drain = pin, drain
        self._acl, self._kernel = acl, kernel_release
        self._routes: tuple[tuple[str, ...], str] | None = None
        self._buffers: dict[int, _Buffer] = {}
        self._lock = threading.Lock()

    def routes(self) -> tuple[tuple[str, ...], str]:
        """The pinning routes (see :func:`choose_pin_routes`), chosen at first use."""
        with self._lock:
            if self._routes is None:
                self._acl = self._acl if self._acl is not None else load_acl()
                self._routes = choose_pin_routes(self._acl, self._kernel or os.uname().release)
                if self.pin and not self._routes[0]:
                    log.warning("kvhal-npu: host buffers stay pageable: %s", self._routes[1])
            return self._routes

    def allocate(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` zeroed bytes at a 4 KiB-aligned address, page-locked before returning
        (unless pinning is off or every route fails: then pageable, with a warning)."""
        if nbytes < 1:
            raise ValueError(f"kvhal-npu: kvhal_allocate_host_buffer needs nbytes >= 1, got {nbytes}")
        record: _Buffer | None = None
        routes = self.routes()[0] if self.pin else ()
        for route in routes:
            record = self._malloc_host(nbytes) if route == MALLOC_HOST else self._register(nbytes)
            if record is not None:
                break
        if record is None:
            if routes:
                log.warning("kvhal-npu: %d-byte host buffer left pageable (copies correct, slower)", nbytes)
            record = _Buffer(map_zeroed(nbytes), None, False)
        with self._lock:
            self._buffers[record.tensor.data_ptr()] = record
        return record.tensor

    def _register(self, nbytes: int) -> _Buffer | None:
        assert self._acl is not None and self._acl.register_pinned is not None
        tensor, size = map_zeroed(nbytes), round_to_pages(nbytes)
        code = self._acl.register_pinned(tensor.data_ptr(), size)
        if code != 0:
            log.warning(
                "kvhal-npu: %s(%d bytes, ACL_HOST_REG_PINNED) failed: aclError %s",
                REGISTER,
                size,
                acl_error(code),
            )
            return None
        return _Buffer(tensor, REGISTER, True)

    def _malloc_host(self, nbytes: int) -> _Buffer | None:
        acl = self._acl
        assert acl is not None and acl.malloc_host is not None and acl.free_host is not None
        total = nbytes + PAGE  # the runtime aligns to 64 bytes; slice to 4 KiB
        code, ptr = acl.malloc_host(total)
        if code != 0 or not ptr:
            log.warning("kvhal-npu: %s(%d bytes) failed: aclError %s", MALLOC_HOST, total, acl_error(code))
            return None
        memory = (ctypes.c_int8 * total).from_address(ptr)
        # aclrtFreeHost runs when the last view of the memory goes (free() drops ours).
        release = weakref.finalize(memory, _free_host, acl.free_host, ptr)
        release.atexit = False  # at exit the runtime may be finalised already; the OS takes it back
        base = torch.frombuffer(memory, dtype=torch.int8)
        base.zero_()  # "memory allocated by this API is not initialized" (aclrtMallocHost docs)
        offset = (-ptr) % PAGE
        return _Buffer(base[offset : offset + nbytes], MALLOC_HOST, True)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether one of this object's buffers is page-locked; for any other, what torch says."""
        with self._lock:
            record = self._buffers.get(buffer.data_ptr())
        return record.pinned if record is not None else bool(buffer.is_pinned())

    def free(self, buffer: torch.Tensor) -> None:
        """Drain the device, then unregister ``buffer`` (or let ``aclrtFreeHost`` release it
        once its last view goes).

        Drains whatever the pin state: a copy from pageable memory may be in flight too.
        """
        with self._lock:
            record = self._buffers.pop(buffer.data_ptr(), None)
        if self._drain is not None:
            self._drain()
        if record is None or record.route != REGISTER:
            return
        assert self._acl is not None and self._acl.unregister is not None
        code = self._acl.unregister(record.tensor.data_ptr())
        if code != 0:
            log.warning("kvhal-npu: aclrtHostUnregister failed with aclError %s", acl_error(code))
