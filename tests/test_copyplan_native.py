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


# --- what no caller may hand them (issue 38) ----------------------------------------------------

int64_dtypes = st.sampled_from([np.int64, np.uint64])
wrong_dtypes = st.sampled_from([np.float64, np.int32, np.uint8, np.dtype(">i8"), np.complex64])


@settings(max_examples=examples(200), deadline=None)
@given(
    wrong=wrong_dtypes,
    which=st.integers(0, 5),
    values=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=6, max_size=6),
)
def test_buffers_of_another_type_are_refused_not_reinterpreted(wrong, which, values):
    """Before: only the item size was checked, so a float64 (or big-endian) array's bytes
    were read as int64 ids, addresses and sizes."""
    table = np.array([values], dtype=np.int64)
    arrays = [table, np.zeros((1, 3), np.int64), np.zeros((1, 2), np.int64)] + [np.zeros(8, np.int64)] * 3
    arrays = [a.copy() for a in arrays]
    arrays[which] = arrays[which].astype(wrong)
    with pytest.raises((TypeError, ValueError, BufferError)):
        copyplan.native.descriptors(*arrays)
    pairs, runs = np.zeros((2, 2), np.int64), np.zeros((2, 3), np.int64)
    with pytest.raises((TypeError, ValueError, BufferError)):
        copyplan.native.plan_runs(
            pairs.astype(wrong) if which % 2 else pairs, runs if which % 2 else runs.astype(wrong), 4, 4
        )
    if copy_engine.native is not None:
        three = [np.zeros(1, np.int64) for _ in range(3)]
        three[which % 3] = three[which % 3].astype(wrong)
        with pytest.raises((TypeError, ValueError)):
            copy_engine.native.copy_batch(*three, -1)


@settings(max_examples=examples(300), deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=6, max_size=6), max_size=4),
    runs=st.lists(st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * 3), max_size=4),
    pairs=st.lists(st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * 2), max_size=4),
    room=st.integers(0, 20),
    dtype=int64_dtypes,
)
def test_descriptors_of_any_int64_values_wrap_as_numpy_does(rows, runs, pairs, room, dtype):
    """Any values: the arithmetic wraps (defined; UBSan checks it in tests/test_sanitizers.py)
    and nothing is written past the outputs' room; numpy's wrapping int64 math is the reference."""
    table = np.array(rows, np.int64).reshape(-1, 6)
    r, p = np.array(runs, np.int64).reshape(-1, 3), np.array(pairs, np.int64).reshape(-1, 2)
    out = np.full((3, room + 4), 7, np.int64)
    need = sum(len(r) if row[5] else len(p) for row in table)
    if need > room:
        with pytest.raises(ValueError, match="descriptors"):
            copyplan.native.descriptors(
                table.astype(dtype), r, p, out[0, :room], out[1, :room], out[2, :room]
            )
        return
    n = copyplan.native.descriptors(table.astype(dtype), r, p, out[0, :room], out[1, :room], out[2, :room])
    assert n == need and (out[:, room:] == 7).all()
    with np.errstate(over="ignore"):
        want = [
            (
                row[0] + ids[:, 0] * row[1],
                row[2] + ids[:, 1] * row[3],
                row[4] * r[:, 2] if row[5] else np.full(len(p), row[4]),
            )
            for dense in (1, 0)
            for row in table
            if bool(row[5]) == bool(dense)
            for ids in [r if dense else p]
        ]
    if want:
        assert (out[:, :n] == np.concatenate([np.stack(w) for w in want], axis=1)).all()


@pytest.mark.skipif(copy_engine.native is None, reason="native kernel not built")
@pytest.mark.parametrize(
    ("sizes", "part", "parts", "says"),
    [
        ([2**62, 2**62, 2**62, 2**62], 0, 2, "overflow 64 bits"),  # a total past 2**64 wrapped
        ([2**63 - 1, 2**63 - 1, 2], 1, 3, "overflow 64 bits"),
        ([100], 2**40 - 1, 2**40, "parts in"),  # (total % parts) * part overflowed
        ([100], 0, 0, "part must"),
    ],
)
def test_the_kernel_refuses_sizes_and_shares_its_arithmetic_cannot_hold(sizes, part, parts, says):
    """Before: the byte total and the share bounds wrapped, and a share's length came out
    negative: a copy of most of the address space. Refused before any byte moves."""
    src, dst = np.zeros(16, np.uint8), np.zeros(16, np.uint8)
    ptrs = [np.full(len(sizes), a.ctypes.data, np.int64) for a in (src, dst)]
    with pytest.raises(ValueError, match=says):
        copy_engine.native.copy_batch(*ptrs, np.array(sizes, np.int64), -1, part, parts)
