"""Which host bytes device copies may still be writing.

A batched copy may be told that its source can be read out of stream order
(CUDA's ``CU_MEMCPY_SRC_ACCESS_ORDER_ANY``, HIP's equivalent): the DMA engine
may then read the source before earlier work on the stream, including the
wait on the compute stream, has finished. That is only safe when nothing
in flight can write the source (vLLM #39306). Device KV is written by compute,
so stores (device -> host) never get the hint. A load (host -> device) reads
host memory, which only kvhal's own stores write from the device; this
registry remembers the host ranges of stores not yet known complete, and a
load gets the hint only when its source meets none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvhal.accel.descriptors import Descriptors, ranges_overlap
from kvhal.copyplan import Direction


@dataclass(frozen=True)
class _Pending:
    done: Callable[[], bool]
    starts: object
    sizes: object


class PendingHostWrites:
    """Host byte ranges written by device -> host copies that may not have completed."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()

    def add(self, descriptors: Descriptors, done: Callable[[], bool]) -> None:
        """Remember a store's destination ranges until ``done()`` reports it complete.

        ``done`` must be cheap and non-blocking (an event query); if it raises,
        the store counts as pending.
        """
        with self._lock:
            self._prune()  # stores alone must not let the list grow without bound
            self._pending.append(_Pending(done, descriptors.dst.copy(), descriptors.sizes.copy()))

    def _prune(self) -> None:
        alive = []
        for item in self._pending:
            try:
                finished = item.done()
            except Exception:  # a failed store may still be writing: keep it
                finished = False
            if not finished:
                alive.append(item)
        self._pending = alive

    def __len__(self) -> int:
        with self._lock:
            self._prune()
            return len(self._pending)

    def may_be_written(self, descriptors: Descriptors) -> bool:
        """Whether an unfinished store may still write any source byte of ``descriptors``."""
        with self._lock:
            self._prune()
            return any(
                ranges_overlap(descriptors.src, descriptors.sizes, p.starts, p.sizes)  # type: ignore[arg-type]
                for p in self._pending
            )


def source_may_be_read_early(
    direction: Direction, descriptors: Descriptors, pending: PendingHostWrites
) -> bool:
    """Whether a copy may let the device read its source out of stream order.

    Only loads (host -> device) whose host source no unfinished store writes.
    """
    return direction is Direction.H2D and not pending.may_be_written(descriptors)
