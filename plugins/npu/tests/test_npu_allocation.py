"""vllm-ascend's per-layer (K, V) tensors, each at a 2 MiB-aligned address."""

from __future__ import annotations

import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.torch_copy import torch_copy
from kvhal.blocks import get_kv_from_block, put_kv_into_block
from kvhal.copyplan import plan_copy
from kvhal.errors import ValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import BLNHC, LBNHC
from kvhal_npu.allocation import ALIGNMENT, aligned_bytes, allocate_aligned_kv_cache
from kvhal_npu.plugin import NPUPlugin

SPLIT = KVGeometry(3, 6, 16, 2, 64, torch.bfloat16, kv_format=KVFormat.SPLIT)
MLA = KVGeometry(2, 4, 16, 1, 512, torch.bfloat16, kv_format=KVFormat.SPLIT, head_size_v=64)


def test_aligned_bytes():
    buffer = aligned_bytes(1000, "cpu")
    assert buffer.numel() == 1000 and buffer.data_ptr() % ALIGNMENT == 0 and int(buffer.abs().sum()) == 0


@pytest.mark.parametrize("geometry", [SPLIT, MLA], ids=["kv", "mla-nope-rope"])
def test_every_layer_and_part_is_its_own_aligned_tensor_in_ascend_shape(geometry):
    cache = NPUPlugin().kvhal_allocate_kv_cache(geometry, LBNHC, torch.device("cpu"))
    assert len(cache.storage) == geometry.num_layers * 2
    for parts in cache.layers:
        for part, view in enumerate(parts):
            assert view.data_ptr() % ALIGNMENT == 0
            # Ascend indexes (num_blocks, block_size, num_kv_heads, head_size).
            ascend = view.permute(0, 2, 1, 3)
            assert ascend.is_contiguous()
            assert tuple(ascend.shape) == (
                geometry.num_blocks,
                geometry.block_size,
                geometry.num_kv_heads,
                geometry.content_size(part),
            )
    assert not cache.overlaps(allocate_aligned_kv_cache(geometry, LBNHC, "cpu"))


def test_blocks_copy_between_ascend_caches_of_different_sizes():
    src = allocate_aligned_kv_cache(SPLIT, LBNHC, "cpu")
    dst = allocate_aligned_kv_cache(SPLIT.with_num_blocks(10), LBNHC, "cpu")
    k = torch.randn(3, 2, 16, 64).to(torch.bfloat16)
    v = torch.randn(3, 2, 16, 64).to(torch.bfloat16)
    put_kv_into_block(src, 4, (k, v))
    plan = plan_copy(src, dst, [(4, 9), (5, 0)])
    assert plan.num_descriptors == 2 * 3 * 2  # one per run, layer and part
    torch_copy(src, dst, Descriptors.of(plan))
    got_k, got_v = get_kv_from_block(dst, 9)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_cross_layer_layout_cannot_be_held_per_layer():
    with pytest.raises(ValidationError, match="layout"):
        allocate_aligned_kv_cache(SPLIT, BLNHC, "cpu")
