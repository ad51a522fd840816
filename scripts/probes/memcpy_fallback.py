"""What the CPU plugin's copies cost without its C kernel (kvhal.cpu._memcpy, not built without
a C compiler): one thread copying 64 MiB (past the caches) in descriptors of vLLM's
layer-separate CPU cache (16 KiB) and of a cross-layer one (512 KiB), through the native batch
kernel and through the ctypes.memmove fallback (one Python call per descriptor, no
non-temporal stores). Median of 15. kvhal.build_info quotes it.

    .venv/bin/python scripts/probes/memcpy_fallback.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvhal.cpu import _memcpy as native
from kvhal.cpu.copy_engine import DEFAULT_NT_THRESHOLD, _python_copy_batch

BATCH = 64 << 20

for chunk in (16 << 10, 512 << 10):
    count = BATCH // chunk
    src, dst = np.zeros(BATCH, np.uint8), np.ones(BATCH, np.uint8)
    offsets = np.arange(count, dtype=np.int64) * chunk
    sizes = np.full(count, chunk, np.int64)
    for name, kernel in (("native", native.copy_batch), ("ctypes.memmove", _python_copy_batch)):
        times = []
        for _ in range(15):
            start = time.perf_counter()
            kernel(src.ctypes.data + offsets, dst.ctypes.data + offsets, sizes, DEFAULT_NT_THRESHOLD)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(
            f"{chunk >> 10} KiB x {count}: {name}: {median * 1e3:.2f} ms, {BATCH / 2**30 / median:.1f} GiB/s"
        )
