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
from concurrent.futures import ThreadPoolExecutor

__all__ = ["name_this_thread", "named_pool"]

_PR_SET_NAME = 15  # linux/prctl.h
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - a libc that cannot be loaded: names stay Python's
    _LIBC = None


def name_this_thread() -> None:
    """Give the calling thread's Python name to the kernel (its first 15 bytes; Linux only)."""
    if _LIBC is None:
        return
    name = threading.current_thread().name.encode(errors="replace")[:15]
    with contextlib.suppress(AttributeError, OSError):  # no prctl: names stay Python's
        _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def named_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads (``PREFIX_N``) carry their names for the kernel too."""
    return ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=name_this_thread)
