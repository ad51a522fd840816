"""Mutants of KV cache allocation."""

from __future__ import annotations

import dataclasses

import torch

from kvhal.cache import KVCache, allocate_dense_kv_cache
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import Capability, DeviceDescriptor, Refusal
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import KVLayout
from kvhal_conformance.mutants.registry import (
    LARGE,
    _replace_caps,
    mutant,
)

#: The dtypes the mutant's allocation table knows; others fall back to float16.
_KNOWN = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@mutant("alloc.as_asked", also=("alloc.refuses",), why="undeclared dtypes are allocated as float16 too")
class DeclaredDtypeAllocatedAsHalf(CPUPlugin):
    """Declares ``dtype.float8_e5m2``, but its allocation table does not know it and allocates
    float16 instead."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), add={"dtype.float8_e5m2"})

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.dtype not in _KNOWN:
            geometry = dataclasses.replace(geometry, dtype=torch.float16)
        return super().kvhal_allocate_kv_cache(geometry, layout, device)


@mutant("alloc.zeroed")
class ZeroesOnlyFirst8MiB(CPUPlugin):
    """Clears new caches with a kernel whose grid covers at most 8 MiB: the rest of a larger
    cache keeps what the memory held (here: 0x5A)."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        cache = super().kvhal_allocate_kv_cache(geometry, layout, device)
        for buffer in cache.storage:
            if buffer.numel() > LARGE:
                buffer[LARGE:].fill_(0x5A)
        return cache


@mutant("alloc.layout")
class SeparateLayerBuffers(CPUPlugin):
    """Allocates every layer of a layer-separate cache as its own buffer (of a size rounded
    up per layer), not one buffer laid out in the layout."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if layout.is_cross_layer:
            return super().kvhal_allocate_kv_cache(geometry, layout, device)
        one = dataclasses.replace(geometry, num_layers=1)
        layers, storage = [], []
        for layer in range(geometry.num_layers):
            cache = allocate_dense_kv_cache(one, layout, device, alignment=4096 * (layer + 1))
            layers.append(cache.layers[0])
            storage += cache.storage
        return KVCache(geometry, layout, tuple(layers), tuple(storage))


@mutant(
    "alloc.cross_layer",
    also=("copy.data", "copy.dst_only", "copy.src_unchanged"),
    why="kvhal refuses to copy between its padded caches and dense host caches of the same layout",
)
class PaddedCrossLayer(CPUPlugin):
    """Pads every layer of a cross-layer block with one spare head, so one block of all
    layers is no longer one contiguous region."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if not layout.is_cross_layer:
            return super().kvhal_allocate_kv_cache(geometry, layout, device)
        padded = allocate_dense_kv_cache(
            dataclasses.replace(geometry, num_kv_heads=geometry.num_kv_heads + 1), layout, device
        )
        heads = geometry.num_kv_heads
        layers = tuple(tuple(view[:, :heads] for view in parts) for parts in padded.layers)
        return KVCache(geometry, layout, layers, padded.storage)


@mutant(
    "alloc.distinct",
    also=("copy.data", "copy.dst_only", "copy.src_unchanged"),
    why="copies of split caches read and write K and V through the same memory",
)
class SplitPartsShareMemory(CPUPlugin):
    """Hands out the K view as the V view too in split (K, V) caches."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        cache = super().kvhal_allocate_kv_cache(geometry, layout, device)
        if geometry.kv_format is not KVFormat.SPLIT or geometry.head_size != geometry.head_size_v:
            return cache
        return KVCache(geometry, layout, tuple((k, k) for k, _ in cache.layers), cache.storage)


@mutant("alloc.refuses")
class SplitNotImplemented(CPUPlugin):
    """Does not declare ``kv.split`` and raises NotImplementedError when asked for a split cache."""

    @hookimpl
    def kvhal_probe(self) -> DeviceDescriptor | Refusal:
        return _replace_caps(super().kvhal_probe(), drop={Capability.SPLIT_KV.value})

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.kv_format is KVFormat.SPLIT:
            raise NotImplementedError("split K/V caches")
        return super().kvhal_allocate_kv_cache(geometry, layout, device)


@mutant(
    "alloc.layout",
    not_judged=("copy.data", "copy.dst_only", "copy.src_unchanged"),
)
class SwapsHNForNonBF16(CPUPlugin):
    """Lays out float16 and float32 caches with H and N swapped (LBNHC asked: LBHNC given) but
    labels them with the layout asked for; bfloat16 caches are right. The copies, judged through
    views that lie, read wrong: they must read "not judged", not blame the copy."""

    @hookimpl
    def kvhal_allocate_kv_cache(
        self, geometry: KVGeometry, layout: KVLayout, device: torch.device
    ) -> KVCache:
        if geometry.dtype not in (torch.float16, torch.float32):
            return super().kvhal_allocate_kv_cache(geometry, layout, device)
        order = list(layout.stride_order)
        h, n = order.index(2), order.index(3)  # H and N in [L, B, H, N, C]
        order[h], order[n] = order[n], order[h]
        swapped = KVLayout.from_name("".join("LBHNC"[d] for d in order))
        cache = allocate_dense_kv_cache(geometry, swapped, device)
        return KVCache(geometry, layout, cache.layers, cache.storage)
