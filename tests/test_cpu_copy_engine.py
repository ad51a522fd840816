"""The CPU plugin's copy engine: shares cover exactly the bytes; native and ctypes kernels agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhal.cpu import copy_engine
from kvhal.cpu.copy_engine import CopyEngine, split_shares
from tests.helpers import examples


@settings(max_examples=examples(200), deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12), shares=st.integers(1, 5))
def test_split_shares_partition_the_bytes(sizes, shares):
    sizes = np.array(sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    src, dst = starts + 1_000_000, starts + 2_000_000
    covered = []
    for s, d, z in split_shares(src, dst, sizes, shares):
        assert (z > 0).all()
        assert (d - s == 1_000_000).all(), "a piece moved its source and destination apart"
        for a, n in zip(s.tolist(), z.tolist(), strict=True):
            covered.extend(range(a, a + n))
    expected = [a for a, n in zip(src.tolist(), sizes.tolist(), strict=True) for a in range(a, a + n)]
    assert sorted(covered) == expected


@pytest.mark.parametrize("kernel", ["native", "python"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_engine_copies_exactly(kernel, threads, monkeypatch):
    if kernel == "native" and copy_engine.native is None:
        pytest.skip("native kernel not built")
    engine = CopyEngine(threads)
    if kernel == "python":
        engine.kernel = copy_engine._python_copy_batch
    monkeypatch.setattr(copy_engine, "PARALLEL_MIN_BYTES", 1)
    rng = np.random.default_rng(threads)
    src = torch.from_numpy(rng.integers(0, 256, 3 << 20, dtype=np.uint8))
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    # odd sizes and offsets exercise the unaligned head and tail of the streaming copy
    sizes = np.array([1, 7, 64, 65, 4095, 70_001, 1 << 20], dtype=np.int64)
    offsets = np.concatenate(([3], 3 + np.cumsum(sizes)[:-1] + np.arange(1, len(sizes)) * 5))
    engine.nt_threshold = 64
    engine.run(src.data_ptr() + offsets, dst.data_ptr() + offsets, sizes)
    expected = torch.zeros_like(dst)
    for o, n in zip(offsets.tolist(), sizes.tolist(), strict=True):
        expected[o : o + n] = src[o : o + n]
    assert torch.equal(dst, expected)


def test_native_kernel_refuses_negative_sizes_before_copying():
    if copy_engine.native is None:
        pytest.skip("native kernel not built")
    src = torch.ones(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    ptrs = np.array([src.data_ptr(), src.data_ptr()]), np.array([dst.data_ptr(), dst.data_ptr() + 8])
    with pytest.raises(ValueError, match="negative copy size"):
        copy_engine.native.copy_batch(ptrs[0], ptrs[1], np.array([8, -1]), 0)
    assert int(dst.sum()) == 0
