"""kvhal's worker threads, named for the kernel too.

Python (before 3.14) names its threads for itself only: ``top -H``, ``/proc/PID/task/*/comm``
and a profiler see every thread of an engine as ``python``, kvhal's among them, and so are the
native threads a library starts from them (a store client's), since a new thread inherits its
creator's kernel name. kvhal's pools give their threads' names to the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

__all__ = ["kernel_name", "name_this_thread", "named_pool"]

_PR_SET_NAME, _PR_GET_NAME = 15, 16  # linux/prctl.h
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - a libc that cannot be loaded: names stay Python's
    _LIBC = None


def _set(name: bytes) -> None:
    if _LIBC is not None:
        with contextlib.suppress(AttributeError, OSError):  # no prctl: names stay Python's
            _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def name_this_thread() -> None:
    """Give the calling thread's Python name to the kernel (its first 15 bytes; Linux only)."""
    _set(threading.current_thread().name.encode(errors="replace"))


@contextlib.contextmanager
def kernel_name(name: str) -> Iterator[None]:
    """The calling thread carries ``name`` for the kernel while the block runs, then its own
    again: the native threads a library starts meanwhile (a store client's) keep ``name``."""
    if _LIBC is None:
        yield
        return
    before = ctypes.create_string_buffer(16)
    try:
        known = _LIBC.prctl(_PR_GET_NAME, before, 0, 0, 0) == 0
    except (AttributeError, OSError):  # pragma: no cover - no prctl
        known = False
    if not known:  # a name that cannot be read cannot be given back: leave it alone
        yield
        return
    _set(name.encode(errors="replace"))
    try:
        yield
    finally:
        _set(before.value)


def named_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads (``PREFIX_N``) carry their names for the kernel too."""
    return ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=name_this_thread)
