"""KV caches: per-layer views over device or host memory, and where each block's bytes lie.

A :class:`KVCache` holds, for every layer, one logical ``[B, H, N, C]`` view
(or a (K, V) pair of them). The views may come from :func:`dense_kv_cache`
(one buffer in a chosen layout) or wrap tensors an engine allocated
(:meth:`KVCache.wrap`). Copies never look at the views' shapes again: they use
:attr:`KVCache.segments`, the contiguous byte runs that make up one block,
derived from the views' real strides.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvhal.errors import ValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import KVLayout

#: Default alignment of each part's region inside a dense buffer.
DEFAULT_ALIGNMENT = 256


@dataclass(frozen=True)
class SegmentFamily:
    """A contiguous byte run present once in every block of a cache.

    Block ``b``'s run starts at ``address + b * block_stride`` and is
    ``length`` bytes long. ``keys`` name the (layer, part, outer index) pieces
    the run holds, in address order, so that two caches' runs can be paired.
    A plugin meets these in :attr:`kvhal.copyplan.CopyPlan.families`.

    :param address: virtual address of block 0's run, in the cache's memory
        (device or host, as the cache's device says); valid while the cache is alive.
    :param length: bytes in one block's run.
    :param block_stride: bytes from one block's run to the next block's.
    :param keys: ``(layer, part, *outer index)`` of each piece the run holds.
    """

    address: int
    length: int
    block_stride: int
    keys: tuple[tuple[int, ...], ...]

    @property
    def dense(self) -> bool:
        """Consecutive blocks' runs touch: a run of block ids is one copy."""
        return self.length == self.block_stride


@dataclass(frozen=True)
class BlockSegments:
    """Where one block's bytes lie: ``merged`` families (adjacent runs joined)
    and the ``fine`` ones (one per layer, part and outer index, in key order).

    :param merged: the fewest runs covering a block, by address.
    :param fine: one run per layer, part and outer index, by key.
    """

    merged: tuple[SegmentFamily, ...]
    fine: tuple[SegmentFamily, ...]

    @property
    def runs_per_block(self) -> int:
        return len(self.merged)


def _view_runs(view: torch.Tensor, key: tuple[int, ...]) -> list[SegmentFamily]:
    """Split one 4-D ``[B, H, N, C]`` view's block into contiguous runs."""
    itemsize = view.element_size()
    inner = [(view.stride(d), view.size(d), d) for d in (1, 2, 3) if view.size(d) > 1]
    inner.sort(reverse=True)
    run_elems, dense_upto = 1, len(inner)
    # A run never spans more than one block's stride: with a single block, an outer
    # dimension (H in LHBNC) can look dense, yet belongs to another run.
    limit = view.stride(0) if view.stride(0) > 0 else None
    for i in range(len(inner) - 1, -1, -1):
        stride, size, _ = inner[i]
        if stride != run_elems or (limit is not None and run_elems * size > limit):
            break
        run_elems *= size
        dense_upto = i
    outer = sorted(inner[:dense_upto], key=lambda t: t[2])  # canonical dim order
    block_stride = view.stride(0) * itemsize
    runs = []
    for index in itertools.product(*(range(size) for _, size, _ in outer)):
        offset = sum(i * stride for i, (stride, _, _) in zip(index, outer, strict=True))
        runs.append(
            SegmentFamily(
                address=view.data_ptr() + offset * itemsize,
                length=run_elems * itemsize,
                block_stride=block_stride,
                keys=(key + tuple(index),),
            )
        )
    return runs


def _merge(runs: list[SegmentFamily]) -> tuple[SegmentFamily, ...]:
    merged: list[SegmentFamily] = []
    for run in sorted(runs, key=lambda r: r.address):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.block_stride == run.block_stride
            and last.address + last.length == run.address
            # one block's run must not reach into the next block's (a one-block cache
            # has a layer stride equal to its block stride: adjacent, not mergeable)
            and last.length + run.length <= run.block_stride
        ):
            merged[-1] = SegmentFamily(
                last.address, last.length + run.length, last.block_stride, last.keys + run.keys
            )
        else:
            merged.append(run)
    return tuple(merged)


def _elements_distinct(view: torch.Tensor) -> bool:
    """Whether no two elements of ``view`` share memory, by a sufficient stride test.

    Taking dimensions by increasing stride, each stride must step past everything
    the smaller ones reach (mixed-radix addressing). Every dense, permuted or padded
    layout passes; partly overlapping blocks (a block stride shorter than a block)
    do not. O(dims), so it costs nothing on the copy path.
    """
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(view.stride(), view.shape, strict=True) if n > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


@dataclass(frozen=True, eq=False)
class KVCache:
    """A KV cache: per-layer logical views plus what keeps their memory alive.

    What ``kvhal_allocate_kv_cache`` returns (build it with
    :func:`allocate_dense_kv_cache`, :func:`dense_kv_cache` or this constructor)
    and what a :class:`~kvhal.copyplan.CopyPlan` copies between. Checked when made:
    the views must have the geometry's shapes and dtype, lie on one device, and
    give every element its own memory (else :class:`~kvhal.errors.ValidationError`).
    The memory stays valid as long as the cache (or a view) is alive.

    :param geometry: the sizes; ``geometry.num_blocks`` is the block count.
    :param layout: the physical order the views were laid out in.
    :param layers: per layer, one ``[B, H, N, C]`` view per part (one for
        STACKED, (K, V) for SPLIT); all on one device, of ``geometry.dtype``.
        ``layers[layer][part]`` indexes them.
    :param storage: backing buffers, held so the views stay valid (for a host
        cache: the buffers from ``kvhal_allocate_host_buffer``).
    """

    geometry: KVGeometry
    layout: KVLayout
    layers: tuple[tuple[torch.Tensor, ...], ...]
    storage: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        g = self.geometry
        if len(self.layers) != g.num_layers:
            raise ValidationError("layers", f"{len(self.layers)} layers given, geometry has {g.num_layers}")
        devices = set()
        for index, parts in enumerate(self.layers):
            if len(parts) != g.num_parts:
                raise ValidationError(
                    "layers",
                    f"layer {index} has {len(parts)} tensors, {g.kv_format.value} needs {g.num_parts}",
                )
            for part, view in enumerate(parts):
                if tuple(view.shape) != g.layer_shape(part):
                    raise ValidationError(
                        "layers",
                        f"layer {index} part {part} has shape {tuple(view.shape)}, "
                        f"expected [B, H, N, C] = {g.layer_shape(part)}",
                    )
                if view.dtype != g.dtype:
                    raise ValidationError(
                        "layers", f"layer {index} part {part} is {view.dtype}, expected {g.dtype}"
                    )
                if not _elements_distinct(view):
                    raise ValidationError(
                        "layers",
                        f"layer {index} part {part} (shape {tuple(view.shape)}, strides {view.stride()}) "
                        "may map two elements to the same memory: blocks would overwrite each other",
                    )
                devices.add(view.device)
        if len(devices) != 1:
            raise ValidationError("layers", f"views span several devices: {sorted(map(str, devices))}")

    @classmethod
    def wrap(
        cls,
        layers: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        layout: KVLayout,
        *,
        head_size: int | None = None,
        storage: Sequence[torch.Tensor] = (),
    ) -> KVCache:
        """Describe tensors someone else allocated (an engine's KV cache).

        ``layers`` holds per layer a logical ``[B, H, N, C]`` view, or a (K, V)
        pair of them. For STACKED views ``head_size`` splits ``C`` into K and
        V; by default ``C`` is split in halves.
        """
        parts = [tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in layers]
        if not parts:
            raise ValidationError("layers", "at least one layer is needed")
        first = parts[0]
        split = len(first) == 2
        num_blocks, heads, block_size, content = first[0].shape
        if split:
            k, v = content, first[1].shape[3]
        else:
            k = head_size if head_size is not None else content // 2
            v = content - k
        geometry = KVGeometry(
            num_layers=len(parts),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_size=k,
            dtype=first[0].dtype,
            kv_format=KVFormat.SPLIT if split else KVFormat.STACKED,
            head_size_v=v,
        )
        return cls(geometry, layout, tuple(parts), tuple(storage))

    @property
    def device(self) -> torch.device:
        """The torch device every view lies on (``cpu`` for a host cache)."""
        return self.layers[0][0].device

    @property
    def num_blocks(self) -> int:
        """Blocks in the cache: valid block ids are ``0 .. num_blocks - 1``."""
        return self.geometry.num_blocks

    def of_layers(self, indices: Sequence[int]) -> KVCache:
        """The cache's layers ``indices`` only: views over the same memory, e.g. to copy a
        block layer by layer."""
        geometry = dataclasses.replace(self.geometry, num_layers=len(indices))
        return KVCache(geometry, self.layout, tuple(self.layers[i] for i in indices), self.storage)

    def layer(self, index: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Layer ``index``'s logical ``[B, H, N, C]`` view, or its (K, V) pair."""
        parts = self.layers[index]
        return parts[0] if len(parts) == 1 else parts

    def kernel_view(self, index: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Layer ``index`` permuted into physical order, the order kernels index it in."""
        order = self.layout.layer_view_order
        views = tuple(v.permute(order) for v in self.layers[index])
        return views[0] if len(views) == 1 else views

    @cached_property
    def segments(self) -> BlockSegments:
        """The contiguous runs that make up one block (derived from real strides)."""
        fine: list[SegmentFamily] = []
        for layer, parts in enumerate(self.layers):
            for part, view in enumerate(parts):
                fine.extend(_view_runs(view, (layer, part)))
        merged = _merge(fine)
        for family in merged:
            if family.length > family.block_stride:
                raise ValidationError(
                    "layers",
                    f"blocks overlap in memory: a run of {family.length} bytes repeats every "
                    f"{family.block_stride} bytes",
                )
        return BlockSegments(merged=merged, fine=tuple(sorted(fine, key=lambda f: f.keys)))

    @cached_property
    def storage_spans(self) -> frozenset[tuple[int, int]]:
        """``(address, nbytes)`` of every distinct torch storage under the views."""
        return frozenset(
            (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) for p in self.layers for v in p
        )

    def overlaps(self, other: KVCache) -> bool:
        """Whether the two caches share memory (same device and intersecting storage)."""
        if self.device != other.device:
            return False
        return any(a < c + d and c < a + b for a, b in self.storage_spans for c, d in other.storage_spans)


def _part_region_bytes(geometry: KVGeometry, part: int) -> int:
    return geometry.num_layers * geometry.num_blocks * geometry.page_bytes(part)


def dense_nbytes(geometry: KVGeometry, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes :func:`dense_kv_cache` needs for ``geometry`` (each part aligned)."""
    total = 0
    for part in range(geometry.num_parts):
        total = _align(total, alignment) + _part_region_bytes(geometry, part)
    return total


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def dense_kv_cache(
    geometry: KVGeometry,
    layout: KVLayout,
    buffer: torch.Tensor,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> KVCache:
    """Lay ``geometry`` out in ``layout`` over a flat byte ``buffer``.

    Each part (K and V of a SPLIT cache) gets one region starting at an
    ``alignment``-byte offset from the buffer's start (offsets are aligned, not the
    buffer's address: allocate an aligned buffer where the device needs one); inside it
    the five logical dims are dense in the layout's order. In a cross-layer layout each
    block of all layers of a part is one contiguous region.

    ``buffer`` needs :func:`dense_nbytes` ``(geometry, alignment)`` bytes: more than
    ``geometry.total_bytes`` where the parts' alignment adds padding.
    """
    if buffer.dim() != 1 or buffer.element_size() != 1:
        raise ValidationError(
            "buffer", f"must be a flat byte tensor, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    need = dense_nbytes(geometry, alignment)
    if buffer.numel() < need:
        raise ValidationError(
            "buffer",
            f"{buffer.numel()} bytes given, {need} needed (kvhal.dense_nbytes(geometry, alignment="
            f"{alignment}): each part starts at an aligned offset, so it can exceed geometry.total_bytes)",
        )
    if buffer.data_ptr() % geometry.itemsize or alignment % geometry.itemsize:
        raise ValidationError(
            "buffer", f"address and alignment must be multiples of the {geometry.dtype} item size"
        )
    order = layout.stride_order
    inverse = [order.index(d) for d in range(len(order))]
    per_part = []
    offset = 0
    for part in range(geometry.num_parts):
        offset = _align(offset, alignment)
        nbytes = _part_region_bytes(geometry, part)
        logical = (geometry.num_layers, *geometry.layer_shape(part))
        physical = [logical[d] for d in order]
        region = buffer[offset : offset + nbytes].view(torch.uint8).view(geometry.dtype)
        per_part.append(region.view(physical).permute(inverse))
        offset += nbytes
    layers = tuple(tuple(t[layer] for t in per_part) for layer in range(geometry.num_layers))
    return KVCache(geometry, layout, layers, (buffer,))


def allocate_dense_kv_cache(
    geometry: KVGeometry,
    layout: KVLayout,
    device: torch.device | str,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> KVCache:
    """One zeroed buffer on ``device`` laid out by :func:`dense_kv_cache`.

    The reference allocation every plugin may use for ``kvhal_allocate_kv_cache``.
    """
    buffer = torch.zeros(dense_nbytes(geometry, alignment), dtype=torch.int8, device=device)
    return dense_kv_cache(geometry, layout, buffer, alignment=alignment)
