"""KV caches laid out as vllm-ascend lays them out: one 2 MiB-aligned tensor per layer and part.

vllm-ascend allocates K and V (nope and rope for MLA) separately, each
padded by 2 MiB and sliced to a 2 MiB-aligned address ("prefill
disaggregation need the addr of cache tensor be aligned with 2M",
``_allocate_kv_cache``/``_align_memory``).
"""

from __future__ import annotations

import torch

from kvhal.cache import KVCache
from kvhal.errors import ValidationError
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout

ALIGNMENT = 2 << 20


def aligned_bytes(nbytes: int, device: torch.device | str, alignment: int = ALIGNMENT) -> torch.Tensor:
    """``nbytes`` zeroed bytes on ``device`` starting at an ``alignment``-aligned address."""
    raw = torch.zeros(nbytes + alignment, dtype=torch.int8, device=device)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes]


def part_view(buffer: torch.Tensor, geometry: KVGeometry, part: int, layout: KVLayout) -> torch.Tensor:
    """``buffer`` as one layer's logical ``[B, H, N, C]`` view of ``part``, laid out in ``layout``."""
    order = layout.layer_view_order
    logical = geometry.layer_shape(part)
    physical = [logical[d] for d in order]
    inverse = [order.index(d) for d in range(len(order))]
    return buffer.view(torch.uint8).view(geometry.dtype).view(physical).permute(inverse)


def allocate_aligned_kv_cache(
    geometry: KVGeometry, layout: KVLayout, device: torch.device | str, alignment: int = ALIGNMENT
) -> KVCache:
    """A zeroed cache with every layer's every part in its own ``alignment``-aligned tensor.

    Only layouts with layers outermost fit separate per-layer tensors.
    """
    if not layout.is_layer_compact:
        raise ValidationError("layout", f"{layout} interleaves layers; Ascend keeps one tensor per layer")
    layers, storage = [], []
    for _ in range(geometry.num_layers):
        parts = []
        for part in range(geometry.num_parts):
            buffer = aligned_bytes(geometry.num_blocks * geometry.page_bytes(part), device, alignment)
            storage.append(buffer)
            parts.append(part_view(buffer, geometry, part, layout))
        layers.append(tuple(parts))
    return KVCache(geometry, layout, tuple(layers), tuple(storage))
