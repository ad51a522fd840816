"""Block copies through the CPU plugin: random mappings, both directions, every layout, four dtypes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvhal
from kvhal.copyplan import plan_by_layer, plan_copy
from kvhal.errors import CopyValidationError
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import BLHNC, LBHNC, STANDARD_LAYOUTS
from tests.helpers import DTYPES, block_bytes, examples, fill_random_bytes, snapshot


def geometry(dtype=torch.bfloat16, kv_format=KVFormat.STACKED, num_blocks=24) -> KVGeometry:
    return KVGeometry(
        num_layers=3,
        num_blocks=num_blocks,
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype=dtype,
        kv_format=kv_format,
    )


@st.composite
def mappings(draw, src_blocks: int, dst_blocks: int):
    n = draw(st.integers(0, min(src_blocks, dst_blocks)))
    src = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
    dst = draw(st.lists(st.integers(0, dst_blocks - 1), min_size=n, max_size=n, unique=True))
    return list(zip(src, dst, strict=True))


def check_copied(src, dst, mapping, dst_before):
    """Every mapped destination block holds its source block; every other one is unchanged."""
    written = {d for _, d in mapping}
    for s, d in mapping:
        assert block_bytes(kvhal.get_kv_from_block(dst, d)) == block_bytes(kvhal.get_kv_from_block(src, s)), (
            f"dst block {d} != src block {s}"
        )
    for d in range(dst.num_blocks):
        if d not in written:
            assert block_bytes(kvhal.get_kv_from_block(dst, d)) == dst_before[d], f"block {d} was touched"


def block_snapshot(cache):
    return [block_bytes(kvhal.get_kv_from_block(cache, b)) for b in range(cache.num_blocks)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", STANDARD_LAYOUTS, ids=str)
@pytest.mark.parametrize("kv_format", list(KVFormat), ids=lambda f: f.value)
@settings(
    max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_store_then_load_round_trip(cpu, dtype, layout, kv_format, data):
    g = geometry(dtype, kv_format)
    device_cache = cpu.allocate_kv_cache(g, layout)
    fill_random_bytes(device_cache, seed=1)
    host = cpu.allocate_host_cache(g, layout, num_blocks=16)
    source_before = snapshot(device_cache)

    store = data.draw(mappings(g.num_blocks, host.num_blocks), label="store")
    host_before = block_snapshot(host)
    cpu.synchronize_event(cpu.copy_blocks(device_cache, host, store))
    check_copied(device_cache, host, store, host_before)
    assert snapshot(device_cache) == source_before, "the source changed"

    # load back into a fresh device cache at other (random) ids
    target = cpu.allocate_kv_cache(g, layout)
    fill_random_bytes(target, seed=2)
    slots = [d for _, d in store]
    dst_ids = data.draw(st.permutations(range(g.num_blocks)), label="dst")[: len(slots)]
    load = list(zip(slots, dst_ids, strict=True))
    target_before = block_snapshot(target)
    cpu.synchronize_event(cpu.copy_blocks(host, target, load))
    check_copied(host, target, load, target_before)
    for (s, _), d in zip(store, dst_ids, strict=True):
        assert block_bytes(kvhal.get_kv_from_block(target, d)) == block_bytes(
            kvhal.get_kv_from_block(device_cache, s)
        )
    cpu.free_host_cache(host)


def test_negative_control_detects_a_wrong_block(cpu):
    """The round-trip check above must catch a copy of the wrong block."""
    g = geometry()
    device_cache = cpu.allocate_kv_cache(g, LBHNC)
    fill_random_bytes(device_cache, seed=3)
    host = cpu.allocate_host_cache(g, LBHNC, num_blocks=4)
    before = block_snapshot(host)
    cpu.synchronize_event(cpu.copy_blocks(device_cache, host, [(5, 0)]))
    with pytest.raises(AssertionError, match="dst block 0 != src block 6"):
        check_copied(device_cache, host, [(6, 0)], before)


def test_empty_mapping_completes_and_moves_nothing(cpu):
    g = geometry()
    cache = cpu.allocate_kv_cache(g, BLHNC)
    fill_random_bytes(cache, seed=4)
    host = cpu.allocate_host_cache(g, BLHNC, 4)
    before = snapshot(host)
    event = cpu.copy_blocks(cache, host, [])
    cpu.synchronize_event(event)
    assert cpu.query_event(event)
    assert snapshot(host) == before


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=str)
def test_runs_of_consecutive_ids_are_coalesced(cpu, layout):
    g = geometry()
    cache = cpu.allocate_kv_cache(g, layout)
    host = cpu.allocate_host_cache(g, layout, 16)
    mapping = [(40 % g.num_blocks, 10), (5, 0), (6, 1), (7, 2), (9, 4)]
    plan = plan_copy(cache, host, mapping)
    assert plan.runs.tolist() == [[5, 0, 3], [9, 4, 1], [16, 10, 1]]
    per_block = cache.segments.runs_per_block
    assert plan.num_descriptors == 3 * per_block
    sizes = plan.descriptors[2]
    assert sizes.sum() == len(mapping) * g.block_bytes
    fill_random_bytes(cache, seed=5)
    before = block_snapshot(host)
    cpu.synchronize_event(cpu.submit(plan))
    check_copied(cache, host, mapping, before)


def test_large_batch_spans_threads(cpu, monkeypatch):
    """A batch above the engine's parallel threshold is split across threads and still exact."""
    engine = cpu._pm.get_plugin("cpu").engine
    monkeypatch.setattr(engine, "threads", 2)  # even on a one-core runner
    kernel = engine.kernel
    ran_on = set()

    def recording_kernel(*args):
        ran_on.add(threading.get_ident())
        return kernel(*args)

    monkeypatch.setattr(engine, "kernel", recording_kernel)
    g = KVGeometry(4, 256, 16, 4, 64, torch.bfloat16)  # 64 KiB a block
    cache = cpu.allocate_kv_cache(g, BLHNC)
    fill_random_bytes(cache, seed=6)
    host = cpu.allocate_host_cache(g, BLHNC, 256)
    rng = np.random.default_rng(0)
    mapping = list(zip(rng.permutation(256).tolist(), rng.permutation(256).tolist(), strict=True))
    before = block_snapshot(host)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, mapping))
    check_copied(cache, host, mapping, before)
    assert len(ran_on) == 2, f"the batch ran on {len(ran_on)} thread(s)"


@pytest.mark.parametrize("layout", STANDARD_LAYOUTS, ids=str)
def test_one_block_host_cache(cpu, layout):
    """A one-slot host tier: in a layer-separate layout its layers touch, yet are separate runs."""
    g = geometry()
    cache = cpu.allocate_kv_cache(g, layout)
    fill_random_bytes(cache, seed=12)
    host = cpu.allocate_host_cache(g, layout, num_blocks=1)
    assert all(f.length <= f.block_stride for f in host.segments.merged)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, [(7, 0)]))
    assert block_bytes(kvhal.get_kv_from_block(host, 0)) == block_bytes(kvhal.get_kv_from_block(cache, 7))
    target = cpu.allocate_kv_cache(g, layout)
    cpu.synchronize_event(cpu.copy_blocks(host, target, [(0, 3)]))
    assert block_bytes(kvhal.get_kv_from_block(target, 3)) == block_bytes(kvhal.get_kv_from_block(cache, 7))


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=str)
@pytest.mark.parametrize("kv_format", list(KVFormat), ids=lambda f: f.value)
def test_a_plan_cut_by_layer_moves_what_the_whole_plan_moves(cpu, layout, kv_format):
    """Each layer's plan copies that layer's bytes of every mapped block; together they
    are the whole copy, in a layer-separate and a cross-layer layout, K and V stacked or split."""
    g = geometry(kv_format=kv_format)
    device_cache = cpu.allocate_kv_cache(g, layout)
    fill_random_bytes(device_cache, seed=5)
    host = cpu.allocate_host_cache(g, layout, num_blocks=6)
    before = block_snapshot(host)
    mapping = [(7, 0), (8, 1), (2, 4), (20, 5)]
    whole = cpu.plan_copy(device_cache, host, mapping)
    views = [device_cache.of_layers([i]) for i in range(g.num_layers)]
    host_views = [host.of_layers([i]) for i in range(g.num_layers)]
    plans = plan_by_layer(whole, views, host_views)
    assert [p.num_blocks for p in plans] == [4] * g.num_layers
    for plan, view, host_view in zip(plans, views, host_views, strict=True):  # computed together, as alone
        alone = plan_copy(view, host_view, mapping).descriptors
        assert all(np.array_equal(a, b) for a, b in zip(plan.descriptors, alone, strict=True))
    assert sum(p.num_bytes for p in plans) == whole.num_bytes
    cpu.synchronize_event(cpu.submit(plans[0]))  # one layer: the others are untouched yet
    assert block_bytes(kvhal.get_kv_from_block(host, 0)) != block_bytes(
        kvhal.get_kv_from_block(device_cache, 7)
    )
    for plan in plans[1:]:
        cpu.synchronize_event(cpu.submit(plan))
    check_copied(device_cache, host, mapping, before)


def test_plan_by_layer_refuses_views_of_other_caches(cpu):
    g = geometry()
    device_cache = cpu.allocate_kv_cache(g, LBHNC)
    other = cpu.allocate_kv_cache(g, LBHNC)
    host = cpu.allocate_host_cache(g, LBHNC, num_blocks=4)
    whole = cpu.plan_copy(device_cache, host, [(1, 0)])
    host_views = [host.of_layers([i]) for i in range(g.num_layers)]
    with pytest.raises(CopyValidationError, match="src"):
        plan_by_layer(whole, [other.of_layers([i]) for i in range(g.num_layers)], host_views)
    with pytest.raises(CopyValidationError, match="dst"):
        plan_by_layer(whole, [device_cache.of_layers([i]) for i in range(g.num_layers)], host_views[:2])
