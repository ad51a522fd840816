"""The transfer engine and the single-process Offloader, on real CPU copies.

Faults are injected by non-device plugins wrapping ``kvhal_copy_blocks`` in
the registry (as a tracing plugin would): the CPU plugin's real stream runs
a failing task, so the copy's own event reports a TransferError.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvhal import KVGeometry, get_kv_from_block
from kvhal.cpu.streams import CPUEvent
from kvhal.errors import BlockStateError, CopyValidationError, ValidationError
from kvhal.hookspecs import hookimpl
from kvhal.layouts import BLHNC
from kvhal.offload.host_tier import HostTier
from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.offload.offloader import Offloader
from kvhal.offload.transfer import TransferEngine, TransferKind
from tests.helpers import drain

GEOMETRY = KVGeometry(2, 16, 4, 2, 8, torch.float32)


def key(h: int, group: int = 0) -> bytes:
    return h.to_bytes(8, "big") + group.to_bytes(4, "big")


class FaultInjector:
    """Wraps ``kvhal_copy_blocks``: can hold the stream, fail the copy's event, or raise."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.fail_event = False
        self.raise_now = False

    @staticmethod
    def _boom():
        raise RuntimeError("injected copy failure")

    @hookimpl(wrapper=True)
    def kvhal_copy_blocks(self, plan, stream):
        if self.raise_now:
            raise RuntimeError("injected submission failure")
        stream.submit(self.gate.wait)  # runs before the copy on the same stream
        event = yield
        if self.fail_event:
            stream.submit(self._boom)  # the next event recorded carries the error
            event = CPUEvent()
            stream.record(event)
        return event


@pytest.fixture
def faults(registry):
    injector = FaultInjector()
    registry.register(injector, "fault-injector")
    yield injector
    injector.gate.set()


@pytest.fixture
def device(registry, faults):
    return registry.select("cpu")


def filled_cache(device, geometry=GEOMETRY, layout=None):
    cache = device.allocate_kv_cache(geometry, layout)
    for parts in cache.layers:
        for view in parts:
            view.copy_(torch.randn_like(view))
    return cache


@pytest.fixture
def rig(registry, device):
    cache = filled_cache(device)
    tier = HostTier.for_geometry(device, GEOMETRY, 4 * GEOMETRY.block_bytes)
    manager = OffloadingManager(tier.pool, registry=registry, enable_events=True)
    offloader = Offloader(manager, TransferEngine(device), tier, [cache])
    yield offloader, manager, cache
    offloader.engine.wait()
    tier.close()


def test_store_then_load_moves_the_bytes(rig):
    offloader, manager, cache = rig
    before = {b: get_kv_from_block(cache, b) for b in (3, 5, 9)}
    job = offloader.store(0, [key(1), key(2)], [3, 5])
    assert job.keys == [key(1), key(2)]
    [result] = offloader.wait([job.job_id])
    assert result.success and result.kind is TransferKind.STORE
    assert manager.lookup([key(1), key(2)]) == 2
    load = offloader.load(0, [key(2), key(1)], [9, 10])
    assert manager.loads_in_flight(key(2)) == 1
    [result] = offloader.wait([load])
    assert result.success and manager.loads_in_flight(key(2)) == 0
    assert torch.equal(get_kv_from_block(cache, 9), before[5])
    assert torch.equal(get_kv_from_block(cache, 10), before[3])
    # Negative control: block 9 did change, so the comparison above saw loaded bytes.
    assert not torch.equal(before[9], before[5])


def test_poll_does_not_block_and_a_store_is_not_loadable_in_flight(rig, faults):
    offloader, manager, _ = rig
    faults.gate.clear()
    job = offloader.store(0, [key(1)], [0])
    assert offloader.poll() == []
    assert manager.state(key(1)) is BlockState.STORING and manager.lookup([key(1)]) == 0
    assert offloader.engine.pending == 1
    faults.gate.set()
    results = offloader.wait()
    assert [r.job_id for r in results] == [job.job_id]
    assert manager.lookup([key(1)]) == 1 and offloader.engine.pending == 0


def test_failed_store_frees_its_slots_and_never_becomes_loadable(rig, faults):
    offloader, manager, _ = rig
    manager.take_events()
    faults.fail_event = True
    job = offloader.store(0, [key(1), key(2)], [1, 2])
    assert manager.num_free == 2
    [result] = offloader.wait([job.job_id])
    assert not result.success and "injected copy failure" in result.error
    assert result.keys == (key(1), key(2))
    assert manager.state(key(1)) is BlockState.ABSENT and manager.lookup([key(1)]) == 0
    assert manager.num_free == 4
    with pytest.raises(BlockStateError):
        offloader.load(0, [key(1)], [0])
    assert manager.take_events() == []  # never announced as stored, so nothing to retract


def test_failed_load_reports_the_device_blocks_to_recompute(rig, faults):
    offloader, manager, _ = rig
    offloader.wait([offloader.store(0, [key(1), key(2)], [1, 2]).job_id])
    faults.fail_event = True
    load = offloader.load(0, [key(1), key(2)], [7, 4])
    [result] = offloader.wait([load])
    assert not result.success and result.kind is TransferKind.LOAD
    assert sorted(result.failed_block_ids) == [4, 7]
    # The host copy is intact: the blocks stay loadable and evictable again.
    assert manager.lookup([key(1), key(2)]) == 2 and manager.loads_in_flight(key(1)) == 0


def test_a_plugin_raising_at_submission_is_a_failed_job(rig, faults):
    offloader, manager, _ = rig
    faults.raise_now = True
    job = offloader.store(0, [key(1)], [1])
    # reported once the stream has drained whatever part of the copy was queued
    [result] = offloader.wait([job.job_id])
    assert result.job_id == job.job_id and not result.success
    assert "injected submission failure" in result.error
    assert manager.state(key(1)) is BlockState.ABSENT and manager.num_free == 4


def test_bad_block_ids_raise_before_the_manager_changes(rig):
    offloader, manager, _ = rig
    offloader.wait([offloader.store(0, [key(i) for i in range(4)], [0, 1, 2, 3]).job_id])
    manager.take_events()
    for ids, match in [
        ([16], "not a block id"),
        ([-1], "not a block id"),
        ([1, 1], "twice"),
        ([], "0 block"),
    ]:
        keys = [key(9)] if len(ids) != 2 else [key(9), key(10)]
        with pytest.raises(ValidationError, match=match):
            offloader.store(0, keys, ids)
    with pytest.raises(ValidationError, match="group"):
        offloader.store(1, [key(9)], [0])
    # Nothing was evicted to make room for the refused stores.
    assert manager.lookup([key(i) for i in range(4)]) == 4 and manager.take_events() == []
    with pytest.raises(ValidationError, match="not a block id"):
        offloader.load(0, [key(0)], [99])
    assert manager.loads_in_flight(key(0)) == 0


def test_engine_validates_before_any_byte_moves(device):
    cache = filled_cache(device)
    tier = HostTier.for_geometry(device, GEOMETRY, 2 * GEOMETRY.block_bytes)
    engine = TransferEngine(device)
    view = tier.view(GEOMETRY, cache.layout)
    with pytest.raises(CopyValidationError, match="out of range"):
        engine.submit_store([key(1)], cache, view, [(0, 5)])
    with pytest.raises(ValidationError, match="2 keys for 1 block pairs"):
        engine.submit_store([key(1), key(2)], cache, view, [(0, 1)])
    assert engine.pending == 0
    drain(device, *engine._streams.values())
    assert torch.count_nonzero(tier.buffer) == 0
    with pytest.raises(ValidationError, match="not pending"):
        engine.wait([123])
    tier.close()


def test_engine_needs_no_manager_and_tells_a_listener(device):
    """In vLLM's worker process there is no manager: keys ride along, a listener hears results."""
    heard = []
    engine = TransferEngine(device, listener=heard.append)
    cache = filled_cache(device)
    tier = HostTier.for_geometry(device, GEOMETRY, 2 * GEOMETRY.block_bytes)
    view = tier.view(GEOMETRY, cache.layout)
    store = engine.submit_store([key(1)], cache, view, [(6, 1)])
    assert [r.job_id for r in engine.wait([store])] == [store]
    load = engine.submit_load((), view, cache, [(1, 2)])  # keys optional: tracked by job id
    engine.wait()
    assert [(r.job_id, r.kind, r.keys) for r in heard] == [
        (store, TransferKind.STORE, (key(1),)),
        (load, TransferKind.LOAD, ()),
    ]
    assert torch.equal(get_kv_from_block(cache, 2), get_kv_from_block(cache, 6))
    tier.close()


def test_two_groups_share_the_tier(registry, device):
    """Full-attention and sliding-window groups: own device caches, one slot pool."""
    full = KVGeometry(2, 8, 4, 2, 8, torch.float32)
    window = KVGeometry(4, 8, 4, 1, 8, torch.float32)
    caches = [filled_cache(device, full, BLHNC), filled_cache(device, window, BLHNC)]
    tier = HostTier.for_geometry(device, full, 3 * full.block_bytes)
    manager = OffloadingManager(tier.pool, registry=registry)
    offloader = Offloader(manager, TransferEngine(device), tier, caches)
    offloader.store(0, [key(1, 0)], [5])
    offloader.store(1, [key(1, 1)], [6])
    offloader.wait()
    assert {manager.slot(key(1, 0)), manager.slot(key(1, 1))} == {0, 1}
    expected = [get_kv_from_block(caches[0], 5), get_kv_from_block(caches[1], 6)]
    offloader.load(1, [key(1, 1)], [0])
    offloader.load(0, [key(1, 0)], [0])
    offloader.wait()
    assert torch.equal(get_kv_from_block(caches[0], 0), expected[0])
    assert torch.equal(get_kv_from_block(caches[1], 0), expected[1])
    tier.close()


def test_offloader_needs_the_tiers_pool(registry, device):
    tier = HostTier.for_geometry(device, GEOMETRY, 2 * GEOMETRY.block_bytes)
    with pytest.raises(ValidationError, match="one source of truth"):
        Offloader(OffloadingManager(2, registry=registry), TransferEngine(device), tier, [])
    tier.close()


def test_fence_waits_for_the_named_stores_only(device, faults):
    """The compute stream waits for the stores it is given (default: all), not for others."""
    engine = TransferEngine(device)
    cache = filled_cache(device)
    tier = HostTier.for_geometry(device, GEOMETRY, 4 * GEOMETRY.block_bytes)
    view = tier.view(GEOMETRY, cache.layout)
    faults.gate.clear()
    store = engine.submit_store((), cache, view, [(1, 0)])
    compute = device.current_stream()  # the CPU plugin's compute "stream" blocks the caller
    assert engine.fence(compute, []) == 0 and engine.fence(compute, [store + 1]) == 0
    fenced = []
    for job_ids in ([store], None):
        thread = threading.Thread(target=lambda ids=job_ids: fenced.append(engine.fence(compute, ids)))
        thread.start()
        thread.join(timeout=0.5)
        assert fenced == [], "the fence did not wait for the store"
        faults.gate.set()
        thread.join(timeout=10)
        assert fenced == [1]
        engine.wait()
        fenced.clear()
        faults.gate.clear()
        store = engine.submit_store((), cache, view, [(2, 1)])
    faults.gate.set()
    engine.wait()
    tier.close()
