"""Host buffers for the CPU device: page-aligned, pre-faulted, and locked where allowed.

The CPU's equivalent of pinning is keeping pages resident: buffers are zeroed
up front (no page faults on the copy path) and ``mlock``-ed when the process
may lock that much (``RLIMIT_MEMLOCK`` or CAP_IPC_LOCK); otherwise they stay
pageable and :func:`is_locked` says so. ``KVHAL_CPU_MLOCK=0`` skips locking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

PAGE = 4096
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_locked: dict[int, int] = {}
_lock = threading.Lock()


def allocate(nbytes: int) -> torch.Tensor:
    """A zeroed, page-aligned flat int8 tensor of ``nbytes``, locked if possible."""
    raw = torch.zeros(nbytes + PAGE, dtype=torch.int8)
    offset = (-raw.data_ptr()) % PAGE
    buffer = raw[offset : offset + nbytes]
    if os.environ.get("KVHAL_CPU_MLOCK", "1") != "0":
        address = buffer.data_ptr()
        if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0:
            with _lock:
                _locked[address] = nbytes
    return buffer


def is_locked(buffer: torch.Tensor) -> bool:
    with _lock:
        return _locked.get(buffer.data_ptr(), -1) >= buffer.numel()


def release(buffer: torch.Tensor) -> None:
    """Unlock ``buffer``'s pages; its memory goes when the last view is dropped."""
    with _lock:
        nbytes = _locked.pop(buffer.data_ptr(), None)
    if nbytes is not None:
        _libc.munlock(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(nbytes))


def can_lock(nbytes: int = PAGE) -> tuple[bool, str]:
    """Whether this process may lock ``nbytes``, and why not."""
    probe = ctypes.create_string_buffer(nbytes)
    if _libc.mlock(probe, ctypes.c_size_t(nbytes)) == 0:
        _libc.munlock(probe, ctypes.c_size_t(nbytes))
        return True, "mlock allowed"
    return False, f"mlock refused: {os.strerror(ctypes.get_errno())}"
