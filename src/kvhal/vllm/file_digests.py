"""Every byte of a model's weight files digested, in parallel, with a log line as it goes.

Each file is cut into pieces of :data:`PIECE_BYTES`; a pool of threads hashes the pieces of
all the files at once (so one large file is as parallel as many shards), reading
:data:`READ_BYTES` at a time into a buffer of its own with ``os.preadv``. Both the read and
the hash release the GIL. The hash is BLAKE3 (kvhal depends on it already): twice SHA-256 (OpenSSL, with
SHA-NI) and four times BLAKE2b a core on the CI machine, 2.1 GiB/s at best
(``scripts/probes/weights_digest_cost.py``, BENCHMARKS.md). A file's digest is the BLAKE3 of its size and
its pieces' digests, in order.

A file whose identity (:class:`~kvhal.vllm.digest_cache.FileId`) changed while it was read
(a copy still being written) gets a digest that is not kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3

from kvhal.vllm.digest_cache import FileId

__all__ = ["PIECE_BYTES", "digest_files", "reading_threads"]

log = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: Bytes of a file hashed as one task (the unit of parallelism).
PIECE_BYTES = 256 << 20
#: Bytes read at once.
READ_BYTES = 8 << 20
#: A model of at least this many bytes to read is announced, and its progress logged ...
LOG_FROM_BYTES = 1 << 30
#: ... every this many bytes.
LOG_EVERY_BYTES = 4 << 30
_TAG = b"kvhal weights v1\0"


def reading_threads() -> int:
    """Threads reading weights: the usable cores, at least 2 (a disk wants requests in flight),
    at most 16."""
    return max(2, min(16, len(os.sched_getaffinity(0))))


def digest_files(
    files: Sequence[FileId], threads: int | None = None, label: str = "the model"
) -> dict[FileId, tuple[str, bool]]:
    """``{file: (hex digest, whether it may be kept)}`` of every byte of each of ``files``.

    :raises OSError: a file could not be opened or read.
    """
    if not files:
        return {}
    pieces = [(f, i) for f in files for i in range(max(1, -(-f.size // PIECE_BYTES)))]
    progress = _Progress(sum(f.size for f in files), len(files), label)
    local = threading.local()

    def piece(task: tuple[FileId, int]) -> bytes:
        file, i = task
        view = getattr(local, "view", None)
        if view is None:
            view = local.view = memoryview(bytearray(READ_BYTES))
        hasher = blake3.blake3()
        start = i * PIECE_BYTES
        end = min(file.size, start + PIECE_BYTES)
        fd = os.open(file.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
            pos = start
            while pos < end:
                got = os.preadv(fd, [view[: min(READ_BYTES, end - pos)]], pos)
                if got == 0:
                    break  # shorter than it was: its identity says so below
                hasher.update(view[:got])
                pos += got
                progress.add(got)
        finally:
            os.close(fd)
        return hasher.digest()

    with ThreadPoolExecutor(min(threads or reading_threads(), len(pieces)), "kvhal-weights") as pool:
        digests = list(pool.map(piece, pieces))
    result: dict[FileId, tuple[str, bool]] = {}
    at = 0
    for file in files:
        n = max(1, -(-file.size // PIECE_BYTES))
        whole = blake3.blake3(_TAG + file.size.to_bytes(8, "little") + b"".join(digests[at : at + n]))
        at += n
        try:
            stable = FileId.of(file.path) == file
        except OSError:
            stable = False
        if not stable:
            log.warning("kvhal: %s changed while it was read: its digest is not kept", file.path)
        result[file] = (whole.hexdigest(), stable)
    progress.end()
    return result


class _Progress:
    """A log line when a large read starts, every :data:`LOG_EVERY_BYTES`, and when it ends."""

    def __init__(self, total: int, files: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label
        self.loud = total >= LOG_FROM_BYTES
        self.next = LOG_EVERY_BYTES
        self.start = time.monotonic()
        self.lock = threading.Lock()
        if self.loud:
            log.info(
                "kvhal: reading %s's %d weight file(s), %.1f GiB, to tell its weights apart "
                "(their digests are kept: a restart on the same files does not read them)",
                label,
                files,
                total / (1 << 30),
            )

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            if not self.loud or self.done < self.next:
                return
            self.next += LOG_EVERY_BYTES
            done, elapsed = self.done, time.monotonic() - self.start
        log.info(
            "kvhal: read %.1f of %.1f GiB of %s's weights (%.2f GiB/s)",
            done / (1 << 30),
            self.total / (1 << 30),
            self.label,
            done / (1 << 30) / max(elapsed, 1e-9),
        )

    def end(self) -> None:
        elapsed = time.monotonic() - self.start
        (log.info if self.loud else log.debug)(
            "kvhal: %s's weights read in %.1f s (%.1f GiB, %.2f GiB/s)",
            self.label,
            elapsed,
            self.total / (1 << 30),
            self.total / (1 << 30) / max(elapsed, 1e-9),
        )
