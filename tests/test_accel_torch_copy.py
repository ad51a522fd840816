"""The Tensor.copy_ fallback executes a plan's descriptors exactly."""

from __future__ import annotations

import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.torch_copy import ByteSpace, torch_copy
from kvhal.blocks import get_kv_from_block
from kvhal.cache import allocate_dense_kv_cache
from kvhal.copyplan import plan_copy
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import STANDARD_LAYOUTS


def same_kv(a, b) -> bool:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


def filled(geometry, layout, seed):
    cache = allocate_dense_kv_cache(geometry, layout, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for parts in cache.layers:
        for view in parts:
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    return cache


@pytest.mark.parametrize("layout", STANDARD_LAYOUTS, ids=str)
@pytest.mark.parametrize("kv_format", list(KVFormat))
def test_torch_copy_moves_exactly_the_mapped_blocks(layout, kv_format):
    g = KVGeometry(3, 10, 4, 2, 8, torch.bfloat16, kv_format=kv_format)
    src, dst = filled(g, layout, 1), filled(g.with_num_blocks(6), layout, 2)
    before = [get_kv_from_block(dst, b) for b in range(6)]
    mapping = [(2, 0), (3, 1), (7, 4)]
    plan = plan_copy(src, dst, mapping)
    torch_copy(src, dst, Descriptors.of(plan))
    for s, d in mapping:
        assert same_kv(get_kv_from_block(src, s), get_kv_from_block(dst, d))
    for untouched in (2, 3, 5):
        assert same_kv(get_kv_from_block(dst, untouched), before[untouched])


def test_byte_space_finds_the_storage_holding_an_address():
    a, b = torch.arange(8, dtype=torch.int32), torch.arange(100, 104, dtype=torch.int64)
    space = ByteSpace([a[2:], b])
    assert space.view(a.data_ptr() + 4, 8).view(torch.int32).tolist() == [1, 2]
    assert space.view(b.data_ptr() + 8, 8).view(torch.int64).tolist() == [101]


def test_byte_space_refuses_bytes_outside_its_storages():
    a = torch.zeros(16, dtype=torch.uint8)
    space = ByteSpace([a])
    with pytest.raises(ValueError, match="none of the caches"):
        space.view(a.data_ptr() + 10, 8)
    with pytest.raises(ValueError):
        space.view(a.data_ptr() - 1, 1)
