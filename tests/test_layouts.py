"""Layouts and the views a dense allocation gives, checked against an independent numpy model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kvhal
from kvhal.cache import DEFAULT_ALIGNMENT, allocate_dense_kv_cache
from kvhal.errors import LayoutError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import BLHNC, LBHNC, STANDARD_LAYOUTS, KVLayout, layout_by_name

GEOMETRIES = [
    KVGeometry(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_size=6, dtype=torch.float32),
    KVGeometry(
        num_layers=2,
        num_blocks=4,
        block_size=3,
        num_kv_heads=3,
        head_size=4,
        dtype=torch.float32,
        kv_format=KVFormat.SPLIT,
        head_size_v=2,
    ),
]


def test_vllm_layout_table():
    # vLLM 0.32's KVCacheLayout values (vllm/v1/kv_cache_layout.py), spelled out.
    expected = {
        "LBHNC": (0, 1, 2, 3, 4),
        "LBNHC": (0, 1, 3, 2, 4),
        "LHBNC": (0, 2, 1, 3, 4),
        "BLHNC": (1, 0, 2, 3, 4),
        "BLNHC": (1, 0, 3, 2, 4),
        "BHLNC": (1, 2, 0, 3, 4),
    }
    assert {lay.name: lay.stride_order for lay in STANDARD_LAYOUTS} == expected
    assert [lay.name for lay in STANDARD_LAYOUTS if lay.is_cross_layer] == ["BLHNC", "BLNHC", "BHLNC"]
    assert layout_by_name("NHD") == layout_by_name("LBNHC")
    assert layout_by_name("hnd") == LBHNC
    assert BLHNC.layer_view_order == (0, 1, 2, 3)
    assert layout_by_name("LBNHC").layer_view_order == (0, 2, 1, 3)
    assert layout_by_name("LHBNC").layer_view_order == (1, 0, 2, 3)


@pytest.mark.parametrize(
    "order", [(0, 0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3, 5), (1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)]
)
def test_stride_order_must_be_a_permutation(order):
    with pytest.raises(LayoutError, match="not a permutation"):
        KVLayout("custom", order)


def test_name_must_match_order():
    with pytest.raises(LayoutError, match="spells a different order"):
        KVLayout("BLHNC", (0, 1, 2, 3, 4))
    with pytest.raises(LayoutError, match="not a permutation of the letters"):
        KVLayout.from_name("LBHNX")


def reference_offsets(geometry: KVGeometry, layout: KVLayout, part: int) -> np.ndarray:
    """Element offsets (from the part region's start) of every logical [L,B,H,N,C] index.

    Built by numpy: number the elements in physical order, transpose to logical.
    """
    logical = (geometry.num_layers, *geometry.layer_shape(part))
    physical = [logical[d] for d in layout.stride_order]
    numbered = np.arange(int(np.prod(physical))).reshape(physical)
    return numbered.transpose([layout.stride_order.index(d) for d in range(5)])


def part_start_elements(geometry: KVGeometry, part: int) -> int:
    start = 0
    for p in range(part + 1):
        start = -(-start // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        if p == part:
            return start // geometry.itemsize
        start += geometry.num_layers * geometry.num_blocks * geometry.page_bytes(p)
    raise AssertionError


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["stacked", "split"])
@pytest.mark.parametrize("layout", STANDARD_LAYOUTS, ids=str)
def test_views_match_independent_reference(geometry, layout):
    cache = allocate_dense_kv_cache(geometry, layout, "cpu")
    buffer = cache.storage[0].view(torch.float32)
    buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32))
    for part in range(geometry.num_parts):
        expected = reference_offsets(geometry, layout, part) + part_start_elements(geometry, part)
        for layer in range(geometry.num_layers):
            view = cache.layers[layer][part]
            assert tuple(view.shape) == geometry.layer_shape(part)
            np.testing.assert_array_equal(view.numpy(), expected[layer].astype(np.float32))


@pytest.mark.parametrize("layout", STANDARD_LAYOUTS, ids=str)
def test_kernel_view_is_in_physical_order(layout):
    geometry = GEOMETRIES[0]
    cache = allocate_dense_kv_cache(geometry, layout, "cpu")
    view = cache.kernel_view(1)
    strides = view.stride()
    assert list(strides) == sorted(strides, reverse=True), f"{layout}: kernel view strides {strides}"
    logical = geometry.layer_shape(0)
    assert tuple(view.shape) == tuple(logical[d] for d in layout.layer_view_order)
    if layout.is_layer_compact:
        assert view.is_contiguous()


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["stacked", "split"])
@pytest.mark.parametrize("layout", [lay for lay in STANDARD_LAYOUTS if lay.is_cross_layer], ids=str)
def test_cross_layer_blocks_are_contiguous(geometry, layout):
    cache = allocate_dense_kv_cache(geometry, layout, "cpu")
    for part in range(geometry.num_parts):
        span = geometry.num_layers * geometry.page_bytes(part)
        for block in range(geometry.num_blocks):
            addresses = set()
            for layer in range(geometry.num_layers):
                tile = cache.layers[layer][part][block]
                base = tile.data_ptr()
                for index in itertools.product(*(range(s) for s in tile.shape)):
                    offset = sum(i * s for i, s in zip(index, tile.stride(), strict=True))
                    start = base + offset * tile.element_size()
                    addresses.update(range(start, start + tile.element_size()))
            assert max(addresses) - min(addresses) + 1 == span == len(addresses)
    # and the segment table agrees: one run per part, the whole block of every layer
    assert [f.length for f in cache.segments.merged] == [
        geometry.num_layers * geometry.page_bytes(p) for p in range(geometry.num_parts)
    ]


def test_layer_separate_runs():
    geometry = GEOMETRIES[0]
    cache = allocate_dense_kv_cache(geometry, LBHNC, "cpu")
    assert cache.segments.runs_per_block == geometry.num_layers
    lhbnc = allocate_dense_kv_cache(geometry, layout_by_name("LHBNC"), "cpu")
    # H outside B: one run per layer and head
    assert lhbnc.segments.runs_per_block == geometry.num_layers * geometry.num_kv_heads


def test_wrap_engine_tensors_keeps_their_memory():
    geometry = GEOMETRIES[0]
    dense = allocate_dense_kv_cache(geometry, LBHNC, "cpu")
    wrapped = kvhal.KVCache.wrap([dense.layer(i) for i in range(geometry.num_layers)], LBHNC, head_size=6)
    assert wrapped.geometry == geometry
    assert wrapped.layers[2][0].data_ptr() == dense.layers[2][0].data_ptr()
    assert [f.length for f in wrapped.segments.merged] == [f.length for f in dense.segments.merged]
