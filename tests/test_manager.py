"""The offloading manager's contract, case by case (the state machine covers sequences)."""

from __future__ import annotations

import pytest

from kvhal.errors import BlockStateError, PolicyError, ValidationError
from kvhal.offload.eviction import EvictionPolicy, LRUPolicy
from kvhal.offload.host_tier import SlotPool
from kvhal.offload.manager import BlockState, OffloadEvent, OffloadingManager


def key(h: int, group: int = 0) -> bytes:
    """vLLM 0.32's OffloadKey: a block hash followed by the group index in 4 bytes."""
    return h.to_bytes(8, "big") + group.to_bytes(4, "big")


def stored(manager: OffloadingManager, keys: list[bytes]) -> None:
    plan = manager.prepare_store(keys)
    assert plan is not None
    manager.complete_store(plan.keys)


@pytest.fixture
def manager(registry) -> OffloadingManager:
    return OffloadingManager(4, registry=registry, enable_events=True)


def test_ready_only_after_successful_complete_store(manager):
    a, b = key(1), key(2)
    plan = manager.prepare_store([a, b])
    assert plan.keys == [a, b] and plan.slots == [0, 1] and plan.evicted == []
    assert manager.lookup([a, b]) == 0
    assert manager.state(a) is BlockState.STORING
    with pytest.raises(BlockStateError, match="still being stored"):
        manager.prepare_load([a])
    manager.complete_store([a])
    assert manager.lookup([a, b]) == 1
    manager.complete_store([b], success=False)
    assert manager.state(b) is BlockState.ABSENT
    assert manager.lookup([a, b]) == 1
    assert manager.num_free == 3  # b's slot came back
    assert manager.take_events() == [OffloadEvent([a], removed=False)]  # b was never announced


def test_lookup_is_the_ready_prefix(manager):
    stored(manager, [key(1), key(2), key(4)])
    assert manager.lookup([key(1), key(2), key(3), key(4)]) == 2
    assert manager.lookup([key(3), key(1)]) == 0
    assert manager.lookup([]) == 0


def test_prepare_store_skips_present_keys_and_duplicates(manager):
    stored(manager, [key(1)])
    plan = manager.prepare_store([key(1), key(2), key(2)])
    assert plan.keys == [key(2)]
    assert manager.prepare_store([key(1), key(2)]).keys == []  # storing or ready: skipped


def test_groups_share_one_pool(manager):
    """Keys of two KV cache groups are just different keys in the same slots."""
    full, window = key(7, group=0), key(7, group=1)
    plan = manager.prepare_store([full, window])
    assert plan.keys == [full, window] and len(set(plan.slots)) == 2
    manager.complete_store([window])
    assert manager.lookup([window]) == 1 and manager.lookup([full]) == 0
    stored(manager, [key(8, 0), key(8, 1)])
    assert manager.num_free == 0
    # Filling up evicts across groups by recency alone (entry order, as in vLLM):
    # the storing `full` is passed over, `window` goes.
    plan = manager.prepare_store([key(9, 1)])
    assert plan.evicted == [window]
    manager.complete_store([full])
    assert manager.prepare_store([key(10, 0)]).evicted == [full]


def test_lru_evicts_least_recent_and_touch_puts_the_first_key_last(manager):
    keys = [key(i) for i in range(4)]
    stored(manager, keys)
    manager.touch([keys[1], keys[0]])  # keys[1] is now the most recent
    plan = manager.prepare_store([key(10), key(11), key(12)])
    assert plan.evicted == [keys[2], keys[3], keys[0]]
    assert manager.lookup([keys[1]]) == 1


def test_blocks_being_loaded_or_stored_are_not_evicted(manager):
    a, b, c, d = (key(i) for i in range(4))
    stored(manager, [a, b])
    manager.prepare_store([c, d])  # storing: pinned
    manager.prepare_load([a])
    manager.prepare_load([a])  # two loads of a
    plan = manager.prepare_store([key(5)])
    assert plan.evicted == [b]
    assert manager.prepare_store([key(6)]) is None  # a loading, c d storing, key(5) storing
    manager.complete_load([a])
    assert manager.prepare_store([key(6)]) is None  # one load still in flight
    manager.complete_load([a])
    assert manager.prepare_store([key(6)]).evicted == [a]


def test_prepare_store_does_not_evict_its_own_keys(manager):
    keys = [key(i) for i in range(4)]
    stored(manager, keys)
    plan = manager.prepare_store([keys[0], key(9)])  # keys[0] is the LRU one but listed
    assert plan.keys == [key(9)] and plan.evicted == [keys[1]]


def test_prepare_store_none_changes_nothing(manager):
    stored(manager, [key(0), key(1)])
    manager.prepare_load([key(0), key(1)])
    manager.take_events()
    assert manager.prepare_store([key(i) for i in range(10, 13)]) is None
    assert manager.num_free == 2 and len(manager) == 2
    assert manager.take_events() == []
    assert manager.prepare_store([key(i) for i in range(10, 15)]) is None  # more than all slots


@pytest.mark.parametrize("success", [True, False])
def test_second_complete_store_is_refused(manager, success):
    manager.prepare_store([key(1)])
    manager.complete_store([key(1)], success=success)
    with pytest.raises(BlockStateError, match="complete_store needs a store in flight") as info:
        manager.complete_store([key(1)])
    assert info.value.argument == "keys"


def test_bad_calls_are_refused_whole(manager):
    stored(manager, [key(1)])
    manager.prepare_store([key(2)])
    manager.take_events()
    for call, keys, match in [
        (manager.complete_store, [key(2), key(9)], "not offloaded"),
        (manager.complete_store, [key(2), key(2)], "listed twice"),
        (manager.prepare_load, [key(1), key(9)], "not offloaded"),
        (manager.complete_load, [key(1)], "ready with 0|needs a load"),
    ]:
        with pytest.raises(BlockStateError, match=match):
            call(keys)
    # Nothing moved: key(2) still storing, key(1) still ready without loads.
    assert manager.state(key(2)) is BlockState.STORING
    assert manager.loads_in_flight(key(1)) == 0 and manager.num_evictable == 1
    assert manager.take_events() == []


def test_complete_load_counts_duplicates(manager):
    stored(manager, [key(1)])
    manager.prepare_load([key(1)])
    with pytest.raises(BlockStateError, match="listed 2 times, 1 loads"):
        manager.complete_load([key(1), key(1)])
    assert manager.loads_in_flight(key(1)) == 1
    manager.prepare_load([key(1), key(1)])
    manager.complete_load([key(1), key(1), key(1)])
    assert manager.loads_in_flight(key(1)) == 0


def test_touch_ignores_unknown_keys(manager):
    stored(manager, [key(1)])
    manager.touch([key(5), key(1), key(6)])  # documented no-op for key(5), key(6)
    assert len(manager) == 1


def test_keys_must_be_bytes(manager):
    with pytest.raises(ValidationError, match="keys are bytes; got str"):
        manager.prepare_store([key(1), "hash"])
    for call in (manager.prepare_store, manager.lookup, manager.prepare_load, manager.touch):
        with pytest.raises(ValidationError, match="keys are bytes; got list") as info:
            call([key(1), [1, 2]])
        assert info.value.argument == "keys"
    assert len(manager) == 0 and manager.num_free == 4


@pytest.mark.parametrize("one_key", [b"hash-a", bytearray(b"hash-a"), "hash-a"])
def test_a_single_key_is_refused_where_a_sequence_is_expected(manager, one_key):
    # bytes iterate as ints: lookup(b"k") silently answered 0 and touch(b"k") did nothing
    stored(manager, [key(1)])
    calls = (
        manager.lookup,
        manager.touch,
        manager.prepare_load,
        manager.complete_load,
        manager.prepare_store,
        manager.complete_store,
    )
    for call in calls:
        with pytest.raises(ValidationError, match=r"sequence of keys.*pass \[key\]") as info:
            call(one_key)
        assert info.value.argument == "keys"
    assert manager.lookup([key(1)]) == 1 and len(manager) == 1  # nothing changed
    manager.touch(iter([key(1)]))  # any other iterable of keys is still fine


@pytest.mark.parametrize("slots", [0, -3, 2.5, True])
def test_slot_count_must_be_positive(registry, slots):
    with pytest.raises(ValidationError) as info:
        OffloadingManager(slots, registry=registry)
    assert info.value.argument == "num_slots"


def test_events_off_by_default(registry):
    manager = OffloadingManager(2, registry=registry)
    stored(manager, [key(1)])
    assert manager.take_events() == []


def test_pool_must_start_free(registry):
    pool = SlotPool(4)
    pool.allocate(1)
    with pytest.raises(ValidationError, match="entirely free"):
        OffloadingManager(pool, registry=registry)


def test_broken_policy_is_caught_before_state_changes(registry):
    class EvictsPinned(LRUPolicy):
        def evict(self, n, pinned):
            return [slot for slot in range(self.num_slots) if pinned[slot]][:n]

    manager = OffloadingManager(2, EvictsPinned(2), registry=registry)
    stored(manager, [key(1), key(2)])
    manager.prepare_load([key(1)])
    with pytest.raises(PolicyError, match="pinned"):
        manager.prepare_store([key(3)])
    assert manager.lookup([key(1), key(2)]) == 2


def test_policy_object_must_be_a_policy(registry):
    with pytest.raises(ValidationError) as info:
        OffloadingManager(2, policy=object(), registry=registry)
    assert info.value.argument == "policy"
    assert isinstance(LRUPolicy(2), EvictionPolicy)


class _FixedVictims(LRUPolicy):
    """A policy whose evict() returns a given list, whatever is asked (a broken contract)."""

    def __init__(self, num_slots, victims):
        super().__init__(num_slots)
        self.victims = victims

    def evict(self, n, pinned):
        return list(self.victims)


def _manager_state(manager, keys):
    return (
        [manager.state(k) for k in keys],
        [manager.slot(k) for k in keys],
        manager.num_free,
        manager.num_evictable,
        manager.num_storing,
        len(manager),
        manager.pool.num_free,
    )


@pytest.mark.parametrize(
    ("victims", "match"),
    [
        ([], r"evict\(1\) returned 0 slots, 0 distinct"),  # too few
        ([0, 1], r"evict\(1\) returned 2 slots, 2 distinct"),  # too many
        ([3], r"slot that is free, pinned or out of range: \[3\]"),  # a free slot
        ([4], r"slot that is free, pinned or out of range: \[4\]"),  # out of range, above
        ([-1], r"slot that is free, pinned or out of range: \[-1\]"),  # out of range, below
    ],
)
def test_policy_returning_bad_victims_is_caught_before_state_changes(registry, victims, match):
    policy = _FixedVictims(4, victims)
    manager = OffloadingManager(4, policy, registry=registry, enable_events=True)
    keys = [key(i) for i in range(3)]
    stored(manager, keys)  # slots 0-2 ready, slot 3 free
    manager.take_events()
    before = _manager_state(manager, [*keys, key(7), key(8)])
    with pytest.raises(PolicyError, match=match):
        manager.prepare_store([key(7), key(8)])  # one free slot, one to evict
    assert _manager_state(manager, [*keys, key(7), key(8)]) == before
    assert manager.lookup(keys) == 3
    assert manager.take_events() == []


def test_policy_returning_duplicates_is_caught_before_state_changes(registry):
    policy = _FixedVictims(4, [0, 0])
    manager = OffloadingManager(4, policy, registry=registry, enable_events=True)
    keys = [key(i) for i in range(4)]
    stored(manager, keys)
    manager.take_events()
    new = [key(7), key(8)]
    before = _manager_state(manager, keys + new)
    with pytest.raises(PolicyError, match=r"evict\(2\) returned 2 slots, 1 distinct"):
        manager.prepare_store(new)
    assert _manager_state(manager, keys + new) == before
    assert manager.lookup(keys) == 4
    assert manager.take_events() == []


def test_policy_choosing_a_block_being_stored_is_caught(registry):
    """A storing block (refs -1) is as pinned as a loading one."""
    policy = _FixedVictims(2, [1])
    manager = OffloadingManager(2, policy, registry=registry)
    stored(manager, [key(1)])
    manager.prepare_store([key(2)])  # slot 1 storing
    before = _manager_state(manager, [key(1), key(2), key(3)])
    with pytest.raises(PolicyError, match=r"free, pinned or out of range: \[1\]"):
        manager.prepare_store([key(3)])
    assert _manager_state(manager, [key(1), key(2), key(3)]) == before
    assert manager.state(key(2)) is BlockState.STORING
