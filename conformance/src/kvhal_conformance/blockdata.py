"""Filling KV caches with a distinct pattern per block and checking where bytes went.

Every comparison is bitwise (through an integer view of the element type), so
a copy that converts, rounds or canonicalizes values is caught, and fp8 needs
no float comparison. Caches are read back as one ``[L, B, H, N, C]`` integer
tensor per part (one for stacked K/V, two for split), on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvhal.cache import KVCache

Snapshot = tuple[torch.Tensor, ...]
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the element's width."""
    return tensor.view(_INT_OF_SIZE[tensor.element_size()])


def fill(cache: KVCache, seed: int) -> Snapshot:
    """Write random bits (a different pattern in every block) into ``cache``; return them.

    Any bit pattern of the element type may appear, NaNs included: a copy that converts or
    canonicalizes values fails as surely as one that moves the wrong bytes.
    """
    g = cache.geometry
    rng = np.random.default_rng(seed)
    int_type = _INT_OF_SIZE[g.itemsize]
    np_type = torch.empty((), dtype=int_type).numpy().dtype
    written = []
    for part in range(g.num_parts):
        shape = (g.num_layers, *g.layer_shape(part))
        info = np.iinfo(np_type)
        snapshot = torch.from_numpy(rng.integers(info.min, info.max, shape, dtype=np_type, endpoint=True))
        for layer, views in enumerate(cache.layers):
            bits(views[part]).copy_(snapshot[layer].to(cache.device))
        written.append(snapshot)
    return tuple(written)


def clear(cache: KVCache) -> Snapshot:
    """Zero ``cache``; return its (zero) contents. Cheaper than :func:`fill` for big caches."""
    g = cache.geometry
    for views in cache.layers:
        for view in views:
            view.zero_()
    int_type = _INT_OF_SIZE[g.itemsize]
    return tuple(torch.zeros((g.num_layers, *g.layer_shape(p)), dtype=int_type) for p in range(g.num_parts))


def read(cache: KVCache, block_ids: Sequence[int] | np.ndarray | None = None) -> Snapshot:
    """The cache's contents (or only ``block_ids``') as ``[L, B, H, N, C]`` integers per part."""
    parts = []
    for part in range(cache.geometry.num_parts):
        layers = [views[part] for views in cache.layers]
        if block_ids is not None:
            index = torch.as_tensor(np.ascontiguousarray(block_ids, dtype=np.int64), device=cache.device)
            layers = [view.index_select(0, index) for view in layers]
        parts.append(torch.stack([bits(view).cpu() for view in layers]))
    return tuple(parts)


def take(snapshot: Snapshot, block_ids: Sequence[int] | np.ndarray) -> Snapshot:
    """Blocks ``block_ids`` of a snapshot, in that order."""
    index = torch.as_tensor(np.ascontiguousarray(block_ids, dtype=np.int64))
    return tuple(part.index_select(1, index) for part in snapshot)


def blocks_equal(a: Snapshot, b: Snapshot) -> torch.Tensor:
    """Per block (dim 1), whether every part of ``a`` equals ``b`` bitwise (broadcasting)."""
    return _per_block(a, b, some_layer=False)


def some_layer_equal(a: Snapshot, b: Snapshot) -> torch.Tensor:
    """Per block (dim 1), whether some layer of some part of ``a`` equals ``b``'s bitwise: a
    block read while it was being written holds some layers old and some new."""
    return _per_block(a, b, some_layer=True)


def _per_block(a: Snapshot, b: Snapshot, some_layer: bool) -> torch.Tensor:
    found = None
    for x, y in zip(a, b, strict=True):
        eq = np.equal(x.numpy(), y.numpy())  # numpy reduces the small inner dims many times faster
        per_layer = eq.reshape(eq.shape[0], eq.shape[1], -1).all(axis=2)
        if some_layer:
            per_block = per_layer.any(axis=0)
            found = per_block if found is None else found | per_block
        else:
            per_block = per_layer.all(axis=0)
            found = per_block if found is None else found & per_block
    assert found is not None
    return torch.from_numpy(found)


def block_label(block: int, num_blocks: int) -> str:
    if block == num_blocks - 1:
        return f"block {block} (the last block)"
    if block == 0:
        return f"block {block} (the first block)"
    return f"block {block}"


def id_list(ids: Sequence[int] | np.ndarray, limit: int = 8) -> str:
    ids = [int(i) for i in ids]
    shown = ", ".join(map(str, ids[:limit]))
    return (
        f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)})" if len(ids) > limit else f"[{shown}]"
    )


def mapping_preview(mapping: np.ndarray, limit: int = 6) -> str:
    pairs = ", ".join(f"{s}->{d}" for s, d in mapping[:limit].tolist())
    more = f", ... {len(mapping) - limit} more" if len(mapping) > limit else ""
    return f"mapping (src->dst, {len(mapping)} pairs): [{pairs}{more}]"
