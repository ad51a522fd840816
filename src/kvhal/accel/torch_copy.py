"""Executing a plan's descriptors with ``Tensor.copy_``: the fallback for any torch device.

Each descriptor is a byte range inside one of the caches' storages. A
:class:`ByteSpace` maps an address back to a flat ``uint8`` view of the
storage that holds it, so a descriptor becomes ``dst[a:b].copy_(src[c:d])``.
On an accelerator the copies are enqueued on the current stream (the caller
enters the copy stream first); ``non_blocking=True`` keeps them asynchronous
where the host side is pinned and leaves them correct where it is not.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.cache import KVCache


class ByteSpace:
    """The storages behind some tensors, addressable by raw pointer."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            if base not in spans:
                spans[base] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self._bases = sorted(spans)
        self._flat = [spans[b] for b in self._bases]

    @classmethod
    def of(cls, cache: KVCache) -> ByteSpace:
        return cls(view for parts in cache.layers for view in parts)

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes at ``address`` as a flat ``uint8`` tensor."""
        index = bisect.bisect_right(self._bases, address) - 1
        if index >= 0:
            flat = self._flat[index]
            offset = address - self._bases[index]
            if offset + nbytes <= flat.numel():
                return flat[offset : offset + nbytes]
        raise ValueError(f"bytes [{address:#x}, +{nbytes}) lie in none of the caches' storages")


def torch_copy(src: KVCache, dst: KVCache, descriptors: Descriptors, non_blocking: bool = True) -> None:
    """Copy every descriptor from ``src``'s storages into ``dst``'s with ``Tensor.copy_``."""
    src_space, dst_space = ByteSpace.of(src), ByteSpace.of(dst)
    for s, d, n in zip(
        descriptors.src.tolist(), descriptors.dst.tolist(), descriptors.sizes.tolist(), strict=True
    ):
        dst_space.view(d, n).copy_(src_space.view(s, n), non_blocking=non_blocking)
