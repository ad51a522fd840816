"""Byte descriptors ``(src_ptrs, dst_ptrs, sizes)`` and the cuts batched copy calls need."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from kvhal.copyplan import CopyPlan


class Descriptors(NamedTuple):
    """Copies ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]``; int64 arrays of one length."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, plan: CopyPlan) -> Descriptors:
        """The plan's coalesced descriptors (one per run of consecutive blocks and segment)."""
        return cls(*plan.descriptors)

    @classmethod
    def from_lists(cls, src: list[int], dst: list[int], sizes: list[int]) -> Descriptors:
        return cls(*(np.asarray(a, dtype=np.int64) for a in (src, dst, sizes)))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def select(self, mask: np.ndarray) -> Descriptors:
        """The descriptors where ``mask`` is true, in order."""
        return Descriptors(self.src[mask], self.dst[mask], self.sizes[mask])

    def chunks(self, max_count: int) -> Iterator[Descriptors]:
        """Consecutive pieces of at most ``max_count`` descriptors (``0``: one piece).

        Together the pieces hold every descriptor once, in order; no piece is empty.
        """
        if max_count < 0:
            raise ValueError(f"max_count must be >= 0, got {max_count}")
        step = len(self) if max_count == 0 else max_count
        for start in range(0, len(self), max(step, 1)):
            end = start + step
            yield Descriptors(self.src[start:end], self.dst[start:end], self.sizes[start:end])

    def split_by_size(self, min_bytes: int) -> tuple[Descriptors, Descriptors]:
        """``(large, small)``: descriptors of at least ``min_bytes`` bytes, and the rest."""
        large = self.sizes >= min_bytes
        return self.select(large), self.select(~large)


def ranges_overlap(
    a_starts: np.ndarray, a_sizes: np.ndarray, b_starts: np.ndarray, b_sizes: np.ndarray
) -> bool:
    """Whether any byte range ``[a_starts[i], +a_sizes[i])`` meets any ``[b_starts[j], +b_sizes[j])``.

    Empty ranges meet nothing. Runs in ``O((n + m) log m)``.
    """
    keep_a, keep_b = a_sizes > 0, b_sizes > 0
    a_lo, a_hi = a_starts[keep_a], a_starts[keep_a] + a_sizes[keep_a]
    b_lo, b_hi = b_starts[keep_b], b_starts[keep_b] + b_sizes[keep_b]
    if not len(a_lo) or not len(b_lo):
        return False
    order = np.argsort(b_lo, kind="stable")
    b_lo, b_hi = b_lo[order], b_hi[order]
    # The furthest end among b ranges starting at or before each sorted start.
    reach = np.maximum.accumulate(b_hi)
    # For each a range, the b ranges starting before a's end; the furthest-reaching one
    # overlaps a if it ends after a's start.
    last = np.searchsorted(b_lo, a_hi, side="left") - 1
    has = last >= 0
    return bool(np.any(reach[last[has]] > a_lo[has]))
