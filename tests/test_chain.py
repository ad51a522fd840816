"""The tier chain's decisions: lookups across tiers, promotions, write-through and write-back."""

from __future__ import annotations

import pytest

from kvhal.errors import BlockStateError, ValidationError
from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.tiers.chain import TierChain
from kvhal.tiers.index import TierIndex


def keys(*ids: int) -> list[bytes]:
    return [b"key-%04d" % i for i in ids]


def chain(host_slots: int = 4, lower_slots: int = 16, write: str = "through") -> TierChain:
    return TierChain(OffloadingManager(host_slots), TierIndex(lower_slots, "lru"), write)  # type: ignore[arg-type]


def store(c: TierChain, ks: list[bytes]) -> None:
    """A host store that completes, and (write-through) its write too."""
    planned = c.prepare_store(ks)
    assert planned is not None
    plan, write = planned
    c.complete_store(plan.keys, write=write)
    if write is not None:
        c.complete_write(write)
    for write in c.take_writes():
        c.complete_write(write)


def test_write_through_pins_host_slots_until_written():
    c = chain()
    plan, write = c.prepare_store(keys(0, 1))
    assert c.take_writes() == [], "a write-through travels with its store"
    assert c.lower.state(keys(0)[0]) is BlockState.STORING, "its lower slots are taken with the store"
    c.complete_store(plan.keys, write=write)
    assert write.keys == keys(0, 1) and not write.snapshot
    assert write.host_slots == plan.slots
    assert c.host.loads_in_flight(keys(0)[0]) == 1, "a slot being written must not be evicted"
    assert c.lower.state(keys(0)[0]) is BlockState.STORING
    assert c.lookup(keys(0, 1)) == (2, 0)
    c.complete_write(write)
    assert c.host.loads_in_flight(keys(0)[0]) == 0
    assert c.lower.lookup(keys(0, 1)) == 2


def test_failed_host_store_fails_its_write():
    c = chain()
    plan, write = c.prepare_store(keys(0))
    c.complete_store(plan.keys, success=False, write=write)
    assert not write.pinned
    c.complete_write(write, success=True)  # a worker that stored fine may still report it done
    assert c.lower.state(keys(0)[0]) is BlockState.ABSENT, "a block whose store failed is not below"


def test_lookup_continues_the_host_prefix_below():
    c = chain(host_slots=4)
    store(c, keys(0, 1, 2, 3))
    store(c, keys(4, 5))  # evicts two of the first four from the host tier (LRU: 0 and 1)
    assert c.host.lookup(keys(0)) == 0
    assert c.lookup(keys(0, 1, 2, 3)) == (4, 2), "evicted blocks are found below, then the host's"
    assert c.lookup(keys(4, 5, 9)) == (2, 0)


def test_promotion_loads_through_fresh_host_slots():
    c = chain(host_slots=4)
    store(c, keys(0, 1, 2, 3))
    store(c, keys(4, 5))
    plan = c.prepare_load(keys(0, 1, 2, 3))
    assert plan is not None
    assert plan.promoted == keys(0, 1)
    assert plan.host_hits == keys(2, 3)
    assert plan.promoted_host_slots == [plan.host_slots[0], plan.host_slots[1]]
    assert c.host.state(keys(0)[0]) is BlockState.STORING, "a promoted slot is not loadable until read"
    assert c.lower.loads_in_flight(keys(0)[0]) == 1, "the block below is protected while read"
    c.complete_load(plan)
    assert c.lookup(keys(0, 1, 2, 3)) == (4, 0)
    assert c.lower.loads_in_flight(keys(0)[0]) == 0
    assert c.take_writes() == [], "a promoted block is below already"


def test_failed_promotion_forgets_the_blocks_in_both_tiers():
    c = chain(host_slots=2)
    store(c, keys(0, 1))
    store(c, keys(2, 3))
    plan = c.prepare_load(keys(0, 1))
    c.complete_load(plan, success=False)
    assert c.host.state(keys(0)[0]) is BlockState.ABSENT
    assert c.lower.state(keys(0)[0]) is BlockState.ABSENT, "a block that failed to read is not offered again"
    assert c.lookup(keys(0)) == (0, 0)


def test_promotion_refused_when_the_host_tier_has_no_room():
    c = chain(host_slots=2)
    store(c, keys(0, 1))
    store(c, keys(2, 3))
    c.host.prepare_load(keys(2, 3))  # both host slots busy loading
    assert c.lookup(keys(0, 1)) == (0, 0), "lookup offers no promotion the host cannot take"
    assert c.prepare_load(keys(0, 1)) is None
    assert c.lower.loads_in_flight(keys(0)[0]) == 0, "a refused plan changes nothing"


def test_write_back_writes_evicted_blocks_from_a_snapshot():
    c = chain(host_slots=2, write="back")
    plan, write = c.prepare_store(keys(0, 1))
    assert write is None
    c.complete_store(plan.keys)
    assert c.take_writes() == [], "write-back writes nothing at store time"
    second, _ = c.prepare_store(keys(2))
    (write,) = c.take_writes()
    assert write.snapshot and write.keys == keys(0)
    assert write.host_slots == second.slots, "the snapshot is of the slot the new block reuses"
    c.complete_write(write)
    assert c.lookup(keys(0)) == (1, 1)


def test_write_failure_leaves_nothing_below():
    c = chain()
    plan, write = c.prepare_store(keys(0))
    c.complete_store(plan.keys, write=write)
    c.complete_write(write, success=False)
    assert c.lower.state(keys(0)[0]) is BlockState.ABSENT
    assert c.host.loads_in_flight(keys(0)[0]) == 0


def test_a_full_lower_tier_skips_writes():
    c = chain(host_slots=4, lower_slots=2)
    plan, write = c.prepare_store(keys(0, 1))  # in flight: both lower slots storing
    _, none = c.prepare_store(keys(2))
    assert none is None and c.skipped_writes == 1
    c.complete_store(plan.keys, write=write)
    c.complete_write(write)


def test_bad_input():
    with pytest.raises(ValidationError, match="write"):
        TierChain(OffloadingManager(2), TierIndex(2), "sideways")  # type: ignore[arg-type]
    c = chain()
    with pytest.raises(BlockStateError, match="neither tier"):
        c.prepare_load(keys(7))
    store(c, keys(0, 1, 2, 3))
    store(c, keys(4, 5))  # 0 and 1 now live below only
    with pytest.raises(BlockStateError, match="listed twice"):
        c.prepare_load(keys(0, 0))
    with pytest.raises(BlockStateError, match="not ready in the host tier"):
        TierChain(OffloadingManager(2)).prepare_load(keys(7))


def test_a_store_with_nothing_below_plans_no_write(tmp_path):
    """``below=False``: the host store is planned, the lower tier is neither written nor
    asked for room (a tier too slow to read is not written)."""
    chain = TierChain(OffloadingManager(4, "lru"), TierIndex(4, "clock"), "through")
    plan, write = chain.prepare_store([b"a" * 32, b"b" * 32], below=False)
    assert len(plan.keys) == 2 and write is None
    assert chain.lower.lookup([b"a" * 32]) == 0 and chain.skipped_writes == 0
    plan, write = chain.prepare_store([b"c" * 32])  # the negative control
    assert write is not None and write.keys == [b"c" * 32]
