"""Host buffers for the CPU device: page-aligned, pre-faulted, and locked when promised.

The CPU's equivalent of pinning is keeping pages resident: buffers are zeroed
up front (no page faults on the copy path) and ``mlock``-ed. The plugin
promises locking (declares ``host.pinned``) only when this process may lock
any amount: ``RLIMIT_MEMLOCK`` unlimited or ``CAP_IPC_LOCK``. A limited
``RLIMIT_MEMLOCK`` (8 MiB is common for non-root users) would lock a small
probe and then leave every real host tier unlocked, so with a limit buffers
are not locked at all and the plugin says so. When locking was promised and
``mlock`` still fails, allocation raises instead of handing back pageable
memory. ``KVHAL_CPU_MLOCK=0`` turns locking off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvhal import env
from kvhal.accel.host_buffers import PAGE

MLOCK_ENV = "KVHAL_CPU_MLOCK"
#: Bit of CAP_IPC_LOCK in /proc/self/status's CapEff (linux/capability.h).
CAP_IPC_LOCK = 14
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
#: address -> (bytes locked, the buffer's storage): a buffer dropped without being released
#: leaves its entry behind, and the storage check keeps memory reused at that address from
#: reading as locked.
_locked: dict[int, tuple[int, StorageWeakRef]] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class LockPolicy:
    """Whether host buffers are locked, and the reason ``kvhal devices`` shows."""

    lock: bool
    reason: str


def _format_bytes(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def decide_locking(enabled: bool, memlock_limit: int, cap_ipc_lock: bool) -> LockPolicy:
    """Lock host buffers only if any size can be locked (a pure decision).

    :param enabled: ``KVHAL_CPU_MLOCK`` is not ``0``.
    :param memlock_limit: the soft ``RLIMIT_MEMLOCK`` (``resource.RLIM_INFINITY`` for none).
    :param cap_ipc_lock: the process has ``CAP_IPC_LOCK`` (the limit does not apply).
    """
    if not enabled:
        return LockPolicy(False, f"pageable ({MLOCK_ENV}=0)")
    if cap_ipc_lock:
        return LockPolicy(True, "locked with mlock (CAP_IPC_LOCK)")
    if memlock_limit == resource.RLIM_INFINITY:
        return LockPolicy(True, "locked with mlock (RLIMIT_MEMLOCK unlimited)")
    return LockPolicy(
        False,
        f"pageable: RLIMIT_MEMLOCK is {_format_bytes(memlock_limit)}, too small to lock host tiers "
        "(raise it, e.g. `ulimit -l unlimited`, or grant CAP_IPC_LOCK)",
    )


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def lock_policy() -> LockPolicy:
    """This process's :func:`decide_locking`, read now (limits and settings may change)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return decide_locking(env.read(MLOCK_ENV) != "0", soft, _has_cap_ipc_lock())


def _mlock(address: int, nbytes: int) -> int:
    """``mlock``; 0 or the errno."""
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0:
        return 0
    return ctypes.get_errno()


def allocate(nbytes: int, policy: LockPolicy | None = None) -> torch.Tensor:
    """A zeroed, page-aligned flat int8 tensor of ``nbytes``, locked if ``policy`` says so.

    :raises OSError: locking was promised and ``mlock`` failed (nothing is kept).
    """
    policy = policy or lock_policy()
    raw = torch.zeros(nbytes + PAGE, dtype=torch.int8)
    offset = (-raw.data_ptr()) % PAGE
    buffer = raw[offset : offset + nbytes]
    if policy.lock:
        address = buffer.data_ptr()
        error = _mlock(address, nbytes)
        if error:
            raise OSError(
                error,
                f"mlock of a {_format_bytes(nbytes)} host buffer failed ({os.strerror(error)}) although host "
                f"memory is declared lockable ({policy.reason}); set {MLOCK_ENV}=0 to use pageable memory",
            )
        with _lock:
            _locked[address] = (nbytes, StorageWeakRef(buffer.untyped_storage()))
    return buffer


def _entry(buffer: torch.Tensor) -> int | None:
    """Bytes locked at ``buffer``'s address by this buffer's own storage, or None."""
    entry = _locked.get(buffer.data_ptr())
    if entry is None:
        return None
    nbytes, storage = entry
    if storage.expired() or storage.cdata != buffer.untyped_storage()._cdata:
        return None
    return nbytes


def is_locked(buffer: torch.Tensor) -> bool:
    with _lock:
        nbytes = _entry(buffer)
    return nbytes is not None and nbytes >= buffer.numel()


def release(buffer: torch.Tensor) -> None:
    """Unlock ``buffer``'s pages; its memory goes when the last view is dropped."""
    with _lock:
        nbytes = _entry(buffer)
        if nbytes is not None:
            del _locked[buffer.data_ptr()]
    if nbytes is not None:
        _libc.munlock(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(nbytes))


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2: ten size_t fields, in this order
    _FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        call = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    call.restype = _MallInfo2
    return call


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes the C library's malloc has handed out and not taken back (glibc's ``mallinfo2``:
    in-use arena chunks and mmapped chunks), torch's CPU tensors among them; memory freed and
    kept for reuse does not count. None where the C library has no ``mallinfo2``."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)
