"""The native copy planner (kvhal._copyplan) against the numpy one it replaces on the hot path:
the same pairs, runs and descriptors for every mapping, and for a bad mapping the same
refusal, raised before any byte moves. And the CPU kernel's byte shares: any number of
parts together copy exactly the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhal import copyplan
from kvhal.copyplan import plan_copy
from kvhal.cpu import copy_engine
from kvhal.errors import CopyValidationError
from kvhal.layouts import BLHNC, LBHNC
from tests.helpers import examples
from tests.test_copies import geometry

pytestmark = pytest.mark.skipif(copyplan.native is None, reason="kvhal._copyplan not built")

SRC_BLOCKS, DST_BLOCKS = 24, 16


@pytest.fixture(scope="module")
def caches(request):
    from kvhal.registry import PluginRegistry

    cpu = PluginRegistry().select("cpu")
    made = {}
    for layout in (LBHNC, BLHNC):
        made[layout.name] = (
            cpu.allocate_kv_cache(geometry(torch.float32, num_blocks=SRC_BLOCKS), layout),
            cpu.allocate_host_cache(geometry(torch.float32, num_blocks=DST_BLOCKS), layout, DST_BLOCKS),
        )
    yield made
    for _, host in made.values():
        cpu.free_host_cache(host)


def numpy_plan(src, dst, mapping):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(copyplan, "native", None)
        plan = plan_copy(src, dst, mapping)
        return plan, plan.descriptors


@settings(max_examples=examples(300), deadline=None)
@given(
    layout=st.sampled_from(["LBHNC", "BLHNC"]),
    # ids a little past both ends and repeats on both sides: valid and refused mappings
    pairs=st.lists(st.tuples(st.integers(-2, SRC_BLOCKS + 1), st.integers(-2, DST_BLOCKS + 1)), max_size=20),
    consecutive=st.integers(0, 12),
)
def test_native_plans_equal_numpys(caches, layout, pairs, consecutive):
    src, dst = caches[layout]
    # a run of consecutive ids in front, so that runs longer than one block occur
    pairs = [(i, i + 2) for i in range(consecutive)] + pairs
    try:
        want, want_descriptors = numpy_plan(src, dst, pairs)
    except CopyValidationError as refused:
        with pytest.raises(CopyValidationError) as got:
            plan_copy(src, dst, pairs)
        assert str(got.value) == str(refused)
        return
    got = plan_copy(src, dst, pairs)
    assert np.array_equal(got.mapping, want.mapping)
    assert np.array_equal(got.runs, want.runs)
    assert got.families == want.families
    for mine, theirs in zip(got.descriptors, want_descriptors, strict=True):
        assert mine.dtype == np.int64 and np.array_equal(mine, theirs)


def test_the_input_mapping_is_left_as_it_was(caches):
    src, dst = caches["LBHNC"]
    mapping = np.array([[5, 1], [2, 0], [3, 3]], dtype=np.int64)
    plan = plan_copy(src, dst, mapping)
    assert mapping.tolist() == [[5, 1], [2, 0], [3, 3]], "the plan sorted the caller's array"
    assert plan.mapping.tolist() == [[2, 0], [3, 3], [5, 1]]


def test_a_refused_mapping_names_the_duplicate_destination(caches):
    src, dst = caches["BLHNC"]
    with pytest.raises(CopyValidationError, match=r"duplicate destination block ids: \[4\]"):
        plan_copy(src, dst, [(0, 4), (1, 4)])
    with pytest.raises(CopyValidationError, match=r"dst block ids out of range \[0, 16\): \[16\]"):
        plan_copy(src, dst, [(0, 16)])


@settings(max_examples=examples(200), deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=10),
    parts=st.integers(1, 5),
    nt=st.sampled_from([-1, 16, 1 << 30]),
)
def test_kernel_shares_copy_exactly_the_batch(sizes, parts, nt):
    if copy_engine.native is None:
        pytest.skip("native kernel not built")
    total = sum(sizes)
    rng = np.random.default_rng(total)
    src = torch.from_numpy(rng.integers(1, 256, total + 64, dtype=np.uint8))
    dst = torch.zeros(total + 64, dtype=torch.uint8)
    # descriptors in reverse order and with gaps: shares follow the list, not the addresses
    offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)[::-1].copy()
    sizes_arr = np.array(sizes[::-1], dtype=np.int64)
    for part in range(parts):
        copy_engine.native.copy_batch(
            src.data_ptr() + offsets, dst.data_ptr() + offsets, sizes_arr, nt, part, parts
        )
    assert torch.equal(dst[:total], src[:total]), "the parts together missed or doubled bytes"
    assert not dst[total:].any(), "a part wrote past the batch"


def test_one_part_alone_copies_only_its_share():
    if copy_engine.native is None:
        pytest.skip("native kernel not built")
    src = torch.arange(1, 101, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    ptrs = np.array([src.data_ptr()]), np.array([dst.data_ptr()])
    copy_engine.native.copy_batch(*ptrs, np.array([100]), -1, 1, 3)  # bytes [33, 66)
    assert dst[:33].eq(0).all() and torch.equal(dst[33:66], src[33:66]) and dst[66:].eq(0).all()
    with pytest.raises(ValueError, match="part"):
        copy_engine.native.copy_batch(*ptrs, np.array([100]), -1, 3, 3)
