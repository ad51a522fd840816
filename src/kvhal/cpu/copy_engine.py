"""Executing byte descriptors on the CPU: the native batch kernel, split over threads.

A single thread's memcpy does not reach a machine's memory bandwidth, and
regular stores pollute the cache with KV nobody reads soon (BENCHMARKS.md); a batch is therefore cut into
byte-balanced shares, one per thread, each run by ``kvhal.cpu._memcpy`` with
the GIL released. Without the compiled kernel, ``ctypes.memmove`` does the
same work one descriptor at a time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvhal import env
from kvhal.threads import named_pool

try:
    from kvhal.cpu import _memcpy as native
except ImportError:  # built without a C compiler
    native = None

#: Copies at least this large bypass the cache (non-temporal stores). Low enough for
#: vLLM's layer-separate CPU cache, whose per-layer chunks are 4-32 KiB: at 64 KiB its
#: 16 KiB chunks were written through the cache, 10 GiB/s where these give 14 (BENCHMARKS.md).
DEFAULT_NT_THRESHOLD = 4 << 10
#: Batches smaller than this stay on one thread: a hand-off costs more.
PARALLEL_MIN_BYTES = 1 << 20


def _python_copy_batch(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, _nt: int) -> None:
    memmove = ctypes.memmove
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        memmove(d, s, n)


def split_shares(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, shares: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cut descriptors into ``shares`` pieces of (nearly) equal bytes.

    A descriptor that straddles a cut is split in two, so one huge run is
    shared too. Together the pieces copy exactly the bytes of the input.
    """
    total = int(sizes.sum())
    ends = np.cumsum(sizes)
    starts = ends - sizes
    pieces = []
    for k in range(shares):
        lo, hi = total * k // shares, total * (k + 1) // shares
        if hi <= lo:
            continue
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))
        s, d, z = src[first:last].copy(), dst[first:last].copy(), sizes[first:last].copy()
        a, b = starts[first:last], ends[first:last]
        cut_front = np.maximum(lo - a, 0)
        cut_back = np.maximum(b - hi, 0)
        s += cut_front
        d += cut_front
        z -= cut_front + cut_back
        keep = z > 0
        pieces.append((s[keep], d[keep], z[keep]))
    return pieces


class CopyEngine:
    """Runs descriptor batches on ``threads`` threads (the caller's plus helpers)."""

    def __init__(self, threads: int | None = None, nt_threshold: int | None = None) -> None:
        self.threads = max(1, threads or min(2, os.cpu_count() or 1))
        if nt_threshold is None:
            nt_threshold = int(env.read("KVHAL_CPU_NT_THRESHOLD") or DEFAULT_NT_THRESHOLD)
        #: Copies of at least this many bytes use non-temporal stores.
        self.nt_threshold = nt_threshold
        self.kernel = native.copy_batch if native is not None else _python_copy_batch
        self.name = "native" if native is not None else "ctypes.memmove"
        self._pool: ThreadPoolExecutor | None = None
        #: the next batch fails halfway (kvhal_inject_device_fault's copy_error)
        self._fail_next = False
        self._lock = threading.Lock()

    def fail_next_run(self) -> None:
        """Make the next batch this engine runs, on whichever thread, copy half its bytes and
        raise, as a DMA error after the copy was accepted would."""
        with self._lock:
            self._fail_next = True

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = named_pool(self.threads - 1, "kvhal-cpu-copy")
        return self._pool

    def _take_failure(self) -> bool:
        with self._lock:
            armed, self._fail_next = self._fail_next, False
            return armed

    def run(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
        """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i; blocks until done."""
        if not len(sizes):
            return
        if self._fail_next and self._take_failure():
            self.kernel(*split_shares(src, dst, sizes, 2)[0], self.nt_threshold)
            raise OSError(errno.EIO, "injected device fault: the copy stopped halfway (copy_error)")
        if self.threads == 1 or int(sizes.sum()) < PARALLEL_MIN_BYTES:
            self.kernel(src, dst, sizes, self.nt_threshold)
            return
        if native is not None and self.kernel is native.copy_batch:
            # each thread finds its byte share itself: no planning on the submitting thread,
            # where a dozen numpy calls cost 0.1 ms with the caches cold after a forward
            parts = self.threads
            pieces = [(src, dst, sizes, self.nt_threshold, part, parts) for part in range(parts)]
        else:
            pieces = [(*piece, self.nt_threshold) for piece in split_shares(src, dst, sizes, self.threads)]
        mine, *theirs = pieces
        futures = [self._helpers().submit(self.kernel, *piece) for piece in theirs]
        try:
            self.kernel(*mine)
        finally:
            for future in futures:
                future.result()
