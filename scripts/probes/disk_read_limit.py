"""The disk's O_DIRECT read bandwidth at a returning chat user's size (BENCHMARKS.md, the chat
bench's disk target): 10 MiB in random 96 KiB or 1 MiB requests, 1-16 threads, median of 5.

    .venv/bin/python scripts/probes/disk_read_limit.py [DIRECTORY]   (default /tmp)
"""

from __future__ import annotations

import functools
import mmap
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIZE, TOTAL = 512 << 20, 10 << 20


def _read(fd: int, buffers: list[mmap.mmap], offsets: list[int], i: int) -> None:
    os.preadv(fd, [buffers[i % len(buffers)]], offsets[i])


def main() -> None:
    path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/tmp", "kvhal-disk-read-limit.bin")
    with open(path, "wb") as f:
        for _ in range(SIZE >> 20):
            f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for chunk in (96 << 10, 1 << 20):
            for threads in (1, 4, 8, 16):
                rates = []
                for _ in range(5):
                    offsets = [random.randrange(SIZE // chunk) * chunk for _ in range(TOTAL // chunk)]
                    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
                    read = functools.partial(_read, fd, buffers, offsets)
                    with ThreadPoolExecutor(threads) as pool:
                        start = time.perf_counter()
                        list(pool.map(read, range(len(offsets))))
                        rates.append(TOTAL / (time.perf_counter() - start) / 1e9)
                rate = statistics.median(rates)
                print(f"{chunk >> 10:5d} KiB requests, {threads:2d} threads: {rate:.2f} GB/s")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
