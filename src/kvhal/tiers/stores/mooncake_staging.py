"""Mooncake's staging areas: registered memory that parts are copied through.

RDMA reaches only registered memory, so a part outside every registered range is copied
through a registered area of the client (:class:`Staging`); so are the parts of a small value,
so that it moves as one slice (:data:`COALESCE_BYTES`). :class:`Plan` lays one call's values out
as Mooncake's pointers and sizes, staging what it must.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvhal.errors import ValidationError

if TYPE_CHECKING:
    from kvhal.tiers.stores.mooncake import MooncakeStore

__all__ = ["COALESCE_BYTES", "MIN_STAGING", "Plan", "Staging", "as_bytes"]

#: the smallest staging area this client allocates and registers
MIN_STAGING = 1 << 20
#: a value of several parts (kvhal's header and block) up to this size moves as one slice,
#: staged: a second slice costs about 85 us over TCP, a memcpy of 64 KiB about 5 us
COALESCE_BYTES = 1 << 20


class Staging:
    """A registered area of this client that parts outside registered memory are copied through."""

    def __init__(self, client: Any, size: int) -> None:
        self.array = np.empty(size, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.size = size
        self.rc = int(client.register_buffer(self.address, size))


def as_bytes(memory: memoryview, argument: str, *, writable: bool) -> np.ndarray:
    """``memory`` as a flat uint8 array (its address is ``.ctypes.data``)."""
    if not isinstance(memory, memoryview):
        memory = memoryview(memory)
    if not memory.c_contiguous:
        raise ValidationError(argument, "a part is not contiguous memory")
    if writable and memory.readonly:
        raise ValidationError(argument, "a buffer is read-only")
    if not memory.nbytes:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(memory, np.uint8)


class Plan:
    """One call's pointers and sizes, with its parts outside registered memory staged, and the
    parts of a small value staged together, as one slice (:data:`COALESCE_BYTES`)."""

    def __init__(self, store: MooncakeStore, values: list[list[np.ndarray]]) -> None:
        self.store = store
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        # staged parts: (value, offset in the staging area, offset in the value, part)
        self.staged: list[tuple[int, int, int, np.ndarray]] = []
        self.area: Staging | None = None
        pending: list[tuple[int, int, int]] = []  # (value, slice, offset in the staging area)
        staged_bytes = 0
        for i, parts in enumerate(values):
            parts = [p for p in parts if p.nbytes]  # Mooncake refuses zero-length slices
            total = sum(p.nbytes for p in parts)
            ptrs: list[int] = []
            sizes: list[int] = []
            if len(parts) > 1 and total <= COALESCE_BYTES:
                # one slice costs Mooncake's TCP transport about as much as the block it
                # carries (BENCHMARKS.md, "Shared tier"): a memcpy of a small value is cheaper
                pending.append((i, 0, staged_bytes))
                at = 0
                for part in parts:
                    self.staged.append((i, staged_bytes, at, part))
                    staged_bytes += part.nbytes
                    at += part.nbytes
                ptrs.append(-1)
                sizes.append(total)
            else:
                at = 0
                for part in parts:
                    address = int(part.ctypes.data)
                    if store._registered(address, part.nbytes):
                        ptrs.append(address)
                    else:
                        pending.append((i, len(ptrs), staged_bytes))
                        ptrs.append(-1)  # filled in once the staging area exists
                        self.staged.append((i, staged_bytes, at, part))
                        staged_bytes += part.nbytes
                    sizes.append(part.nbytes)
                    at += part.nbytes
            self.ptrs.append(ptrs)
            self.sizes.append(sizes)
        if staged_bytes:
            self.area = store._take_staging(staged_bytes)
            for i, j, offset in pending:
                self.ptrs[i][j] = self.area.address + offset

    def stage_in(self) -> None:
        if self.area is not None:
            for _, offset, _, part in self.staged:
                self.area.array[offset : offset + part.nbytes] = part

    def stage_out(self, delivered: list[int]) -> None:
        """Copy out the staged bytes of the values delivered (``delivered[i]`` bytes of value i)."""
        if self.area is None:
            return
        for i, offset, at, part in self.staged:
            n = min(part.nbytes, delivered[i] - at)
            if n > 0:
                part[:n] = self.area.array[offset : offset + n]

    def trim(self, i: int, size: int) -> None:
        """Cut value ``i``'s slices to its first ``size`` bytes."""
        ptrs, sizes, left = [], [], size
        for ptr, n in zip(self.ptrs[i], self.sizes[i], strict=True):
            if left <= 0:
                break
            ptrs.append(ptr)
            sizes.append(min(n, left))
            left -= n
        self.ptrs[i], self.sizes[i] = ptrs, sizes

    def release(self) -> None:
        if self.area is not None:
            self.store._give_staging(self.area)
            self.area = None
