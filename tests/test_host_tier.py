"""The host tier: slot pool, pinned buffer from the device plugin, per-group views."""

from __future__ import annotations

import random

import pytest
import torch

from kvhal import KVGeometry, get_kv_from_block, put_kv_into_block
from kvhal.errors import ClosedError, ValidationError
from kvhal.geometry import KVFormat
from kvhal.hookspecs import hookimpl
from kvhal.layouts import BLHNC, LBHNC
from kvhal.offload.host_tier import HostTier, SlotPool


def geometry(layers=2, heads=2, head_size=8, kv_format=KVFormat.STACKED, blocks=4) -> KVGeometry:
    return KVGeometry(layers, blocks, 4, heads, head_size, torch.float32, kv_format)


# -- slot pool ---------------------------------------------------------------


def test_pool_allocates_ascending_and_refuses_when_short():
    pool = SlotPool(5)
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(3) is None
    assert pool.num_free == 2
    assert pool.allocate(2) == [3, 4]


def test_a_freed_run_comes_back_as_a_run():
    pool = SlotPool(8)
    pool.allocate(8)
    pool.free([6, 2, 3, 5])
    assert pool.allocate(4) == [2, 3, 5, 6]


def test_double_free_and_bad_ids_are_refused_whole():
    pool = SlotPool(4)
    pool.allocate(2)
    for ids, match in [([1, 1], "double free"), ([0, 2], "double free"), ([0, 9], "not in")]:
        with pytest.raises(ValidationError, match=match) as info:
            pool.free(ids)
        assert info.value.argument == "ids"
    assert pool.num_free == 2 and not pool.is_free(0) and not pool.is_free(1)


@pytest.mark.parametrize("n", [-1, 1.0, True])
def test_allocate_needs_a_count(n):
    with pytest.raises(ValidationError) as info:
        SlotPool(4).allocate(n)
    assert info.value.argument == "n"


@pytest.mark.parametrize("num_slots", [0, -2])
def test_pool_size_must_be_positive(num_slots):
    with pytest.raises(ValidationError, match="positive"):
        SlotPool(num_slots)


def test_no_fragmentation_growth_under_churn():
    """After any churn, every free slot serves one allocation and the free list stays bounded."""
    pool, rng, held = SlotPool(64), random.Random(0), []
    for _ in range(5000):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            count = rng.randint(1, len(held))
            pool.free(held[:count])
            del held[:count]
        else:
            ids = pool.allocate(rng.randint(1, 8))
            held.extend(ids or [])
        assert pool.num_free + len(held) == 64
    rest = pool.allocate(pool.num_free)
    assert sorted(rest + held) == list(range(64))


# -- host tier -----------------------------------------------------------------


class AllocationRecorder:
    """Records every host buffer the device hands out (a non-device wrapper)."""

    def __init__(self):
        self.sizes, self.addresses = [], []

    @hookimpl(wrapper=True)
    def kvhal_allocate_host_buffer(self, nbytes):
        buffer = yield
        self.sizes.append(nbytes)
        self.addresses.append(buffer.data_ptr())
        return buffer


def test_tier_rounds_down_to_whole_slots_and_pins_through_the_device(registry):
    recorder = AllocationRecorder()
    registry.register(recorder, "allocation-recorder")
    cpu = registry.select("cpu")
    g = geometry()
    tier = HostTier.for_geometry(cpu, g, 5 * g.block_bytes - 1)
    assert tier.num_slots == 4 and tier.capacity_bytes == 4 * g.block_bytes
    # One buffer from the plugin (with room to align), and the tier's bytes lie inside it.
    [size], [address] = recorder.sizes, recorder.addresses
    start = tier.buffer.data_ptr()
    assert address <= start and start + tier.capacity_bytes <= address + size
    assert tier.is_pinned is cpu.descriptor.supports("host.pinned")  # the CPU plugin locks when it may
    assert tier.allocate(4) == [0, 1, 2, 3] and tier.allocate(1) is None
    tier.free([2])
    assert tier.pool.allocate(1) == [2]  # one free list
    tier.close()


@pytest.mark.parametrize(
    ("capacity", "slot", "argument"),
    [
        (0, 64, "capacity_bytes"),
        (-64, 64, "capacity_bytes"),
        (64, 0, "slot_bytes"),
        (32, 64, "capacity_bytes"),
    ],
)
def test_tier_sizes_are_checked(cpu, capacity, slot, argument):
    with pytest.raises(ValidationError) as info:
        HostTier(cpu, capacity, slot)
    assert info.value.argument == argument


@pytest.mark.parametrize("layout", [LBHNC, BLHNC])
def test_slot_i_is_block_i_of_the_view(cpu, layout):
    g = geometry()
    tier = HostTier.for_geometry(cpu, g, 4 * g.block_bytes)
    view = tier.view(g, layout)
    assert view.num_blocks == 4 and view.storage[0] is tier.buffer
    assert tier.view(g.with_num_blocks(99), layout) is view  # cached per geometry and layout
    kv = torch.randn(2, 2, 4, 16)
    put_kv_into_block(view, 2, kv)
    assert torch.equal(get_kv_from_block(view, 2), kv)
    assert not torch.equal(get_kv_from_block(view, 1), kv)
    if layout is BLHNC:  # cross-layer: slot 2 is bytes [2 * slot, 3 * slot)
        raw = tier.buffer[2 * g.block_bytes : 3 * g.block_bytes].view(torch.float32)
        assert torch.equal(raw.view(2, 2, 4, 16), kv)
    tier.close()


def test_views_of_two_groups_must_agree_on_slot_bytes(cpu):
    full = geometry(layers=2, heads=2)
    window = geometry(layers=4, heads=1)  # same block bytes, other layers and page size
    assert full.block_bytes == window.block_bytes
    tier = HostTier.for_geometry(cpu, full, 8 * full.block_bytes)
    tier.view(full, BLHNC)
    tier.view(window, BLHNC)  # cross-layer: every slot is one contiguous run either way
    split = geometry(layers=2, heads=2, head_size=8, kv_format=KVFormat.SPLIT)
    assert split.block_bytes == full.block_bytes
    with pytest.raises(ValidationError, match="other bytes") as info:
        tier.view(split, BLHNC)  # K and V regions: slot i is two runs
    assert info.value.argument == "layout"
    other = HostTier.for_geometry(cpu, full, 8 * full.block_bytes)
    other.view(full, LBHNC)
    with pytest.raises(ValidationError, match="other bytes"):
        other.view(window, LBHNC)
    for t in (tier, other):
        t.close()


def test_split_view_fits_the_buffer(cpu):
    split = geometry(kv_format=KVFormat.SPLIT, head_size=24)  # K region not 256-aligned
    tier = HostTier.for_geometry(cpu, split, 3 * split.block_bytes)
    assert tier.view(split, LBHNC).num_blocks == 3
    tier.close()


def test_view_geometry_must_match_the_slot_size(cpu):
    tier = HostTier(cpu, 4096, 1000)
    with pytest.raises(ValidationError, match="1024 bytes; the tier's slots 1000") as info:
        tier.view(geometry(), LBHNC)
    assert info.value.argument == "geometry"
    tier.close()


class FreeRecorder:
    """Records every host buffer freed through the device (a non-device wrapper)."""

    def __init__(self):
        self.freed = []

    @hookimpl(wrapper=True)
    def kvhal_free_host_buffer(self, buffer):
        self.freed.append(buffer.data_ptr())
        return (yield)


def test_close_frees_the_buffer_through_the_device_once(registry):
    recorder = FreeRecorder()
    registry.register(recorder, "free-recorder")
    cpu = registry.select("cpu")
    g = geometry()
    tier = HostTier.for_geometry(cpu, g, 2 * g.block_bytes)
    address = tier.buffer.data_ptr()
    with tier:
        tier.view(g, LBHNC)
    tier.close()
    assert recorder.freed == [address]
    with pytest.raises(ClosedError, match="the host tier is closed"):
        tier.view(g, LBHNC)
