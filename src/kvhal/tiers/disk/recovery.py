"""The disk tier's index read back at start: the slots whose records agree in every rank.

A block is offered only where every tensor-parallel rank holds an intact record of its
own fingerprint for it, all naming the same key; the rest (another fingerprint, rank or
format, damaged records, ranks that disagree) the chain overwrites.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from kvhal.tiers.disk.directory import open_file, read_records
from kvhal.tiers.disk.format import MAX_KEY_BYTES, record_keys, valid_records

#: Records checked per step (and per ``progress`` call).
RECOVER_CHUNK = 1 << 20


def recover_slots(
    rank_dirs: Sequence[tuple[int, str]],
    digests: Sequence[bytes],
    num_slots: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[int], list[bytes]]:
    """The slots whose records in every rank's ``index.bin`` are intact under that rank's
    fingerprint digest and name the same key; their keys.

    :param rank_dirs: ``(directory descriptor, path for messages)`` of each rank, in order.
    :param digests: each rank's :meth:`~kvhal.tiers.backend.TierSpec.digest`.
    :raises OSError: an index could not be opened or read.
    """
    slots: list[int] = []
    keys: list[bytes] = []
    fds: list[int] = []
    try:
        for dir_fd, where in rank_dirs:
            fds.append(open_file(dir_fd, "index.bin", os.O_RDONLY, where))
        for start in range(0, num_slots, RECOVER_CHUNK):
            n = min(RECOVER_CHUNK, num_slots - start)
            first = read_records(fds[0], start, n)
            mask = valid_records(first, digests[0])
            for fd, digest in zip(fds[1:], digests[1:], strict=True):
                raw = read_records(fd, start, n)
                mask = valid_records(raw, digest, within=mask)
                rows = np.flatnonzero(mask)
                same = (raw[rows, 6:8] == first[rows, 6:8]).all(1) & (
                    raw[rows, 20 : 20 + MAX_KEY_BYTES] == first[rows, 20 : 20 + MAX_KEY_BYTES]
                ).all(1)
                mask[rows[~same]] = False
            rows = np.flatnonzero(mask)
            slots.extend((rows + start).tolist())
            keys.extend(record_keys(first, rows))
            if progress is not None:
                progress(start + n, num_slots)
    finally:
        for fd in fds:
            os.close(fd)
    return slots, keys
