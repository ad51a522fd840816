"""Reading and writing one block's KV in any layout (vLLM PR #6808's two APIs)."""

from __future__ import annotations

import torch

from kvhal.cache import KVCache
from kvhal.errors import ValidationError, check_int

BlockKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _check_block(cache: KVCache, block_id: int) -> None:
    check_int("block_id", block_id, minimum=None)
    if not 0 <= block_id < cache.num_blocks:
        raise ValidationError("block_id", f"{block_id} is out of range [0, {cache.num_blocks})")


def get_kv_from_block(cache: KVCache, block_id: int) -> BlockKV:
    """A copy of block ``block_id`` across all layers.

    :return: ``[L, H, N, C]`` for a STACKED cache, a ``(K, V)`` pair of
        ``[L, H, N, D]`` tensors for a SPLIT one; on the cache's device.
    """
    _check_block(cache, block_id)
    parts = tuple(
        torch.stack([layer[part][block_id] for layer in cache.layers])
        for part in range(cache.geometry.num_parts)
    )
    return parts[0] if len(parts) == 1 else parts  # type: ignore[return-value]


def put_kv_into_block(cache: KVCache, block_id: int, kv: BlockKV) -> None:
    """Write ``kv`` (shaped as :func:`get_kv_from_block` returns) into block ``block_id``.

    Everything is checked before the first byte is written.
    """
    _check_block(cache, block_id)
    g = cache.geometry
    parts = kv if isinstance(kv, (tuple, list)) else (kv,)
    if len(parts) != g.num_parts:
        raise ValidationError(
            "kv", f"{g.kv_format.value} cache takes {g.num_parts} tensor(s), got {len(parts)}"
        )
    for part, tensor in enumerate(parts):
        want = (g.num_layers, g.num_kv_heads, g.block_size, g.content_size(part))
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValidationError("kv", f"part {part} has shape {shape}, expected [L, H, N, C] = {want}")
        if tensor.dtype != g.dtype:
            raise ValidationError("kv", f"part {part} is {tensor.dtype}, cache holds {g.dtype}")
    for part, tensor in enumerate(parts):
        for layer, views in enumerate(cache.layers):
            views[part][block_id].copy_(tensor[layer])
