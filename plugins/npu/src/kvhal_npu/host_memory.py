"""Pinned host buffers on Ascend: torch_npu's pinned allocator (``aclrtMallocHost``).

``torch.zeros(..., pin_memory=True)`` is what vllm-ascend's offloading uses;
with torch_npu imported, torch's pinned allocator is the NPU's. Buffers are
over-allocated by a page and sliced to a 4 KiB-aligned address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

PAGE = 4096


class PinnedHostBuffers:
    """Allocates and tracks pinned host buffers.

    :param pin: whether to pin (``False`` for pageable buffers, e.g. ``KVHAL_PIN_HOST=off``).
    :param drain: called before a buffer is released (a device synchronize), so
        no copy still uses it.
    """

    def __init__(self, pin: bool = True, drain: Callable[[], None] | None = None) -> None:
        self.pin, self._drain = pin, drain
        self._pinned: dict[int, bool] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        raw = torch.zeros(nbytes + PAGE, dtype=torch.int8, pin_memory=self.pin)
        offset = (-raw.data_ptr()) % PAGE
        buffer = raw[offset : offset + nbytes]
        with self._lock:
            self._pinned[buffer.data_ptr()] = bool(self.pin and raw.is_pinned())
        return buffer

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        with self._lock:
            known = self._pinned.get(buffer.data_ptr())
        return known if known is not None else bool(buffer.is_pinned())

    def free(self, buffer: torch.Tensor) -> None:
        """Forget ``buffer``; torch's allocator takes it back when the last view goes."""
        with self._lock:
            known = self._pinned.pop(buffer.data_ptr(), None)
        if known and self._drain is not None:
            self._drain()
