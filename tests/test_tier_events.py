"""KV events for every tier (issue 37, item 3): what the chain tells of the tiers below, and
how it reaches vLLM's publisher (medium, locality, ownership as vLLM defines them)."""

from __future__ import annotations

import msgspec
import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.tiers.chain import ChainTier, TierChain, TierEvent
from kvhal.tiers.index import TierIndex
from kvhal.vllm.config import LowerTierConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.kv_events import HAS_OWNERSHIP, kv_events_enabled, tier_kv_events
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.testing.steps import decode_kv_batch
from tests.test_scheduler_prefetch import finish_stores
from tests.test_scheduler_side import prefill, request, scheduler_config

DISK, REDIS = "disk", "redis"


def keys(*ids: int) -> list[bytes]:
    return [offload_key(b"%031d" % i + b"h", 0) for i in ids]


def chain(disk_slots: int = 4, write: str = "through", events: bool = True) -> TierChain:
    tiers = [ChainTier(DISK, TierIndex(disk_slots, "lru"), write), ChainTier(REDIS)]  # type: ignore[arg-type]
    return TierChain(OffloadingManager(4), tiers, events=events)


def store(c: TierChain, ks: list[bytes], ok: bool = True, write_ok: bool = True) -> None:
    plan, writes = c.prepare_store(ks, (DISK, REDIS))
    c.complete_store(plan.keys, success=ok, writes=writes)
    for write in writes + c.take_writes():
        c.complete_write(write, success=write_ok)


def view(events: list[TierEvent]) -> dict[str, set[bytes]]:
    """A subscriber's view: which tier holds which key."""
    held: dict[str, set[bytes]] = {DISK: set(), REDIS: set()}
    for event in events:
        (held[event.tier].difference_update if event.removed else held[event.tier].update)(event.keys)
    return held


def test_the_view_from_the_events_equals_the_index_evictions_included():
    c = chain()
    events: list[TierEvent] = []
    for i in range(0, 12, 2):  # 12 blocks through a disk of 4 slots
        store(c, keys(i, i + 1))
        events += c.take_tier_events()
    seen = view(events)
    disk = c.tier(DISK).index
    assert seen[DISK] == {k for k in keys(*range(12)) if disk.state(k) is BlockState.READY}
    assert len(seen[DISK]) == len(disk) == 4
    removed = [k for e in events if e.removed for k in e.keys]
    assert len(removed) == c.tier(DISK).evictions == 8 and all(e.tier == DISK for e in events if e.removed)
    assert seen[REDIS] == set(keys(*range(12))), "a store is told every block written, never an eviction"


def test_write_back_announces_a_block_once_written():
    c = chain(write="back")
    store(c, keys(0, 1, 2, 3))
    assert view(c.take_tier_events())[DISK] == set(), "nothing written back yet"
    store(c, keys(4, 5))  # evicts two from the host tier: written back
    assert view(c.take_tier_events())[DISK] == set(keys(0, 1))


def test_nothing_is_announced_of_a_failed_write_or_store():
    c = chain()
    store(c, keys(0, 1), write_ok=False)
    store(c, keys(2, 3), ok=False)  # the host store failed: its write-throughs never ran
    assert c.take_tier_events() == []
    store(c, keys(4, 5, 6, 7))
    assert all(not e.removed for e in c.take_tier_events()), "the failed writes' slots were never announced"


def test_a_failed_read_removes_the_blocks_from_the_local_tier():
    c = chain(disk_slots=8)
    store(c, keys(0, 1))
    store(c, keys(2, 3, 4, 5))  # evicts 0 and 1 from the host tier
    c.take_tier_events()
    plan = c.prepare_load(keys(0, 1))
    c.complete_load(plan, success=False)
    assert c.take_tier_events() == [TierEvent(DISK, keys(0, 1), removed=True)]


def test_no_events_unless_asked():
    c = chain(events=False)
    for i in range(0, 8, 2):
        store(c, keys(i, i + 1))
    assert c.take_tier_events() == []


def test_published_as_vllm_publishes_them():
    events = [TierEvent(DISK, keys(1)), TierEvent(REDIS, keys(2)), TierEvent(DISK, keys(1), removed=True)]
    stored, remote, removed = tier_kv_events(events, [REDIS], block_size=16)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.medium, stored.locality, remote.locality) == ("STORAGE", "LOCAL", "REMOTE")
    assert stored.block_hashes == [int.from_bytes(b"%031d" % 1 + b"h", "big") & (2**64 - 1)]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=[stored, remote, removed]))
    decoded = decode_kv_batch(payload)  # kvhal's own decoder, written to the schema
    assert [e["type"] for e in decoded] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert decoded[1]["locality"] == "REMOTE" and decoded[2]["block_hashes"] == stored.block_hashes
    if HAS_OWNERSHIP:  # vLLM 0.32; 0.27.1's events have no ownership
        assert [e["ownership"] for e in decoded] == [DISK, REDIS, DISK]
    else:
        assert "ownership" not in decoded[0]


def test_events_are_on_where_vllm_publishes_them():
    assert not kv_events_enabled(None)  # vLLM's default: no kv_events_config
    assert not kv_events_enabled(KVEventsConfig())  # set, but enable_kv_cache_events False
    assert kv_events_enabled(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq"))


DISK_SLOT = 4160  # what a slot of PAGE bytes takes on disk (its header, 4 KiB-aligned)


@pytest.mark.parametrize("on", [False, True], ids=["events-off", "events-on"])
def test_the_scheduler_side_keeps_keys_for_events_only_when_they_are_published(tmp_path, on):
    """Over a real disk tier of 4 slots that evicts: without KV events the chain keeps no
    slot's key (about 150 B a block) and no event; with them, one key per block the disk
    holds, and the events say what it stored and evicted."""
    options = {"path": str(tmp_path / "disk"), "bytes_to_use": 4 * DISK_SLOT}
    disk = LowerTierConfig("disk", options, "through", "clock")
    scheduler = SchedulerSide(scheduler_config(slots=4, lower_tier=disk), kv_events=on)
    try:
        for i in range(3):  # three prompts' blocks through a disk of 4 slots
            req = request(f"p{i}", list(range(100 * i, 100 * i + 12)))
            finish_stores(scheduler, prefill(scheduler, req, [1 + 3 * i, 2 + 3 * i, 3 + 3 * i]))
            scheduler.request_finished(req)
        index = scheduler.chain.tier("disk").index
        evicted = scheduler.stats.data["tier_evicted_blocks{tier=disk}"]
        assert len(index) == 4 and evicted == 5  # nine blocks written to the disk, five evicted
        events = scheduler.take_events()
        keys_at = scheduler.chain._keys_at["disk"]  # the slot -> key map events need
        if not on:
            assert events == [] and keys_at == {}
            assert scheduler.manager.take_events() == [] and scheduler.chain.take_tier_events() == []
            return
        assert len(keys_at) == len(index) == 4
        removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
        assert len(removed) == evicted
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
    finally:
        scheduler.close()
