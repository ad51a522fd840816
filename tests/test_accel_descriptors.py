"""Descriptor cuts for batched copy calls, and byte-range overlap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhal.accel.descriptors import Descriptors, ranges_overlap

sizes_lists = st.lists(st.integers(1, 1 << 20), max_size=60)


def descriptors_of(sizes: list[int]) -> Descriptors:
    n = len(sizes)
    return Descriptors.from_lists(list(range(0, 10 * n, 10)), list(range(1, 10 * n + 1, 10)), sizes)


@given(sizes=sizes_lists, max_count=st.integers(0, 9))
def test_chunks_cover_every_descriptor_once_in_order_within_the_limit(sizes, max_count):
    d = descriptors_of(sizes)
    chunks = list(d.chunks(max_count))
    assert all(len(c) > 0 for c in chunks)
    if max_count:
        assert all(len(c) <= max_count for c in chunks)
    else:
        assert len(chunks) == (1 if sizes else 0)
    for field in range(3):
        joined = np.concatenate([c[field] for c in chunks]) if chunks else np.zeros(0, np.int64)
        assert joined.tolist() == d[field].tolist()


def test_chunks_at_8192_for_rocm_counts():
    d = descriptors_of([1] * 20000)
    assert [len(c) for c in d.chunks(8192)] == [8192, 8192, 3616]


def test_chunks_reject_a_negative_limit():
    with pytest.raises(ValueError):
        list(descriptors_of([1]).chunks(-1))


@given(sizes=sizes_lists, threshold=st.integers(0, 1 << 20))
def test_split_by_size_partitions_at_the_threshold(sizes, threshold):
    d = descriptors_of(sizes)
    large, small = d.split_by_size(threshold)
    assert all(s >= threshold for s in large.sizes.tolist())
    assert all(s < threshold for s in small.sizes.tolist())
    assert sorted(large.src.tolist() + small.src.tolist()) == d.src.tolist()
    assert large.nbytes + small.nbytes == d.nbytes


ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=12)


@given(a=ranges, b=ranges)
def test_ranges_overlap_matches_brute_force(a, b):
    def arrays(rs):
        return (np.array([r[0] for r in rs], np.int64), np.array([r[1] for r in rs], np.int64))

    expected = any(sa < sb + nb and sb < sa + na for sa, na in a for sb, nb in b if na > 0 and nb > 0)
    assert ranges_overlap(*arrays(a), *arrays(b)) == expected


def test_touching_ranges_do_not_overlap():
    one = np.array([0]), np.array([10])
    assert not ranges_overlap(*one, np.array([10]), np.array([5]))
    assert ranges_overlap(*one, np.array([9]), np.array([5]))
