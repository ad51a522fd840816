"""Bytes between a host tier's slots and a tier backend, off the engine's thread.

The worker-side half of :mod:`kvhal.tiers.chain`. Where a host slot is one run of
bytes, the backend reads and writes it in place; otherwise (a layer-major
layout puts a slot's bytes in one run per layer) the slots go through a
page-aligned staging buffer, gathered before a write and scattered after a
read, in the backend's completion thread.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from kvhal.offload.host_tier import HostTier
from kvhal.tiers.backend import OK, ReadOutcome, TierBackend


def _staging(rows: int, row_bytes: int) -> np.ndarray:
    """A page-aligned ``[rows, row_bytes]`` byte array (O_DIRECT can use it in place)."""
    memory = mmap.mmap(-1, max(rows * row_bytes, 1))
    return np.frombuffer(memory, dtype=np.uint8, count=rows * row_bytes).reshape(rows, row_bytes)


class TierIO:
    """Moves blocks between ``host``'s slots and ``backend``.

    :param host: the worker's host tier (its views fix where a slot's bytes lie).
    :param backend: a tier backend opened with ``role="io"`` for this worker's rank.
    """

    def __init__(self, host: HostTier, backend: TierBackend) -> None:
        self.host = host
        self.backend = backend

    def write(
        self, keys: Sequence[bytes], host_slots: Sequence[int], lower_slots: Sequence[int], snapshot: bool
    ) -> Future[list[bool]]:
        """Copy host slots ``host_slots`` into the backend's ``lower_slots`` as ``keys``.

        :param snapshot: the host slots may be rewritten as soon as this returns
            (write-back of evicted blocks): their bytes are copied out first.
            Otherwise the caller keeps them unchanged until the future completes.
        """
        if self.host.slots_are_contiguous and not snapshot:
            buffers = [self.host.slot_memory(slot) for slot in host_slots]
            return self.backend.write(lower_slots, keys, buffers)
        rows = _staging(len(host_slots), self.host.slot_bytes)
        self.host.gather_slots(host_slots, rows)
        # the memoryviews keep ``rows`` alive for as long as the backend holds them
        return self.backend.write(lower_slots, keys, [memoryview(row) for row in rows])

    def read(
        self, keys: Sequence[bytes], lower_slots: Sequence[int], host_slots: Sequence[int]
    ) -> Future[list[ReadOutcome]]:
        """Copy the backend's ``lower_slots`` (holding ``keys``) into host slots ``host_slots``.

        The future's result is the backend's outcome per block, as a :class:`ReadOutcome`
        (:data:`OK`: read and verified); the host slots of failed blocks hold undefined bytes.
        """
        contiguous = self.host.slots_are_contiguous
        rows = None if contiguous else _staging(len(host_slots), self.host.slot_bytes)
        if rows is None:
            buffers = [self.host.slot_memory(slot) for slot in host_slots]
        else:
            buffers = [memoryview(row) for row in rows]
        inner = self.backend.read(lower_slots, keys, buffers)
        outer: Future[list[ReadOutcome]] = Future()

        def end(done: Future[list[ReadOutcome]]) -> None:
            try:
                outcomes = [ReadOutcome.of(outcome) for outcome in done.result()]
                if rows is not None:  # scattered from the staging rows
                    good = [i for i, outcome in enumerate(outcomes) if outcome is OK]
                    if good:
                        self.host.scatter_slots([host_slots[i] for i in good], rows[good])
            except BaseException as exc:  # handed to the waiting side, not lost
                outer.set_exception(exc)
            else:
                outer.set_result(outcomes)

        inner.add_done_callback(end)
        return outer
