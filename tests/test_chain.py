"""The tier chain's decisions: lookups across tiers, promotions, write-through and write-back."""

from __future__ import annotations

import pytest

from kvhal.errors import BlockStateError, ValidationError
from kvhal.offload.manager import BlockState, OffloadingManager
from kvhal.tiers.chain import ChainTier, TierChain
from kvhal.tiers.index import TierIndex

DISK = "disk"


def keys(*ids: int) -> list[bytes]:
    return [b"key-%04d" % i for i in ids]


def chain(host_slots: int = 4, lower_slots: int = 16, write: str = "through") -> TierChain:
    """The host tier over one local tier, ``disk``."""
    return TierChain(OffloadingManager(host_slots), [ChainTier(DISK, TierIndex(lower_slots, "lru"), write)])  # type: ignore[arg-type]


def lower(c: TierChain, name: str = DISK) -> TierIndex:
    index = c.tier(name).index
    assert index is not None
    return index


def store(c: TierChain, ks: list[bytes], tiers: tuple[str, ...] = (DISK,)) -> None:
    """A host store that completes, and its write-throughs (and any write-back) too."""
    planned = c.prepare_store(ks, tiers)
    assert planned is not None
    plan, writes = planned
    c.complete_store(plan.keys, writes=writes)
    for write in writes:
        c.complete_write(write)
    for write in c.take_writes():
        c.complete_write(write)


def test_write_through_pins_host_slots_until_written():
    c = chain()
    plan, (write,) = c.prepare_store(keys(0, 1), [DISK])
    assert c.take_writes() == [], "a write-through travels with its store"
    assert lower(c).state(keys(0)[0]) is BlockState.STORING, "its lower slots are taken with the store"
    c.complete_store(plan.keys, writes=[write])
    assert write.tier == DISK and write.keys == keys(0, 1) and not write.snapshot
    assert write.host_slots == plan.slots
    assert c.host.loads_in_flight(keys(0)[0]) == 1, "a slot being written must not be evicted"
    assert lower(c).state(keys(0)[0]) is BlockState.STORING
    assert c.lookup(keys(0, 1)) == (2, 0)
    c.complete_write(write)
    assert c.host.loads_in_flight(keys(0)[0]) == 0
    assert lower(c).lookup(keys(0, 1)) == 2


def test_failed_host_store_fails_its_write():
    c = chain()
    plan, (write,) = c.prepare_store(keys(0), [DISK])
    c.complete_store(plan.keys, success=False, writes=[write])
    assert not write.pinned
    c.complete_write(write, success=True)  # a worker that stored fine may still report it done
    assert lower(c).state(keys(0)[0]) is BlockState.ABSENT, "a block whose store failed is not below"


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
    (read,) = plan.reads
    assert read.tier == DISK and read.keys == keys(0, 1) and plan.read_keys == keys(0, 1)
    assert read.slots == [lower(c).slot(k) for k in keys(0, 1)]
    assert plan.host_hits == keys(2, 3)
    assert read.host_slots == [plan.host_slots[0], plan.host_slots[1]]
    assert c.host.state(keys(0)[0]) is BlockState.STORING, "a promoted slot is not loadable until read"
    assert lower(c).loads_in_flight(keys(0)[0]) == 1, "the block below is protected while read"
    c.complete_load(plan)
    assert c.lookup(keys(0, 1, 2, 3)) == (4, 0)
    assert lower(c).loads_in_flight(keys(0)[0]) == 0
    assert c.take_writes() == [], "a promoted block is below already"


def test_failed_promotion_forgets_the_blocks_in_both_tiers():
    c = chain(host_slots=2)
    store(c, keys(0, 1))
    store(c, keys(2, 3))
    plan = c.prepare_load(keys(0, 1))
    c.complete_load(plan, success=False)
    assert c.host.state(keys(0)[0]) is BlockState.ABSENT
    assert lower(c).state(keys(0)[0]) is BlockState.ABSENT, "a block that failed to read is not offered again"
    assert c.lookup(keys(0)) == (0, 0)


def test_a_promotion_with_some_reads_failed_forgets_only_those_blocks():
    c = chain(host_slots=4)
    store(c, keys(0, 1, 2, 3))
    store(c, keys(4, 5, 6, 7))  # 0-3 only below now
    plan = c.prepare_load(keys(0, 1, 2, 3))
    assert plan is not None and plan.read_keys == keys(0, 1, 2, 3)
    c.complete_load(plan, failed=keys(1))  # block 1 gone below (an expired object)
    assert c.host.state(keys(1)[0]) is BlockState.ABSENT
    assert lower(c).state(keys(1)[0]) is BlockState.ABSENT, "the failed block is not offered again"
    assert [c.host.state(k) for k in keys(0, 2, 3)] == [BlockState.READY] * 3, "the others stay"
    assert c.lookup(keys(0, 1, 2, 3)) == (1, 0), "the hit ends at the block lost"
    assert lower(c).loads_in_flight(keys(2)[0]) == 0


def test_promotion_refused_when_the_host_tier_has_no_room():
    c = chain(host_slots=2)
    store(c, keys(0, 1))
    store(c, keys(2, 3))
    c.host.prepare_load(keys(2, 3))  # both host slots busy loading
    assert c.lookup(keys(0, 1)) == (0, 0), "lookup offers no promotion the host cannot take"
    assert c.prepare_load(keys(0, 1)) is None
    assert lower(c).loads_in_flight(keys(0)[0]) == 0, "a refused plan changes nothing"


def test_write_back_writes_evicted_blocks_from_a_snapshot():
    c = chain(host_slots=2, write="back")
    plan, writes = c.prepare_store(keys(0, 1), [DISK])
    assert writes == []
    c.complete_store(plan.keys)
    assert c.take_writes() == [], "write-back writes nothing at store time"
    second, _ = c.prepare_store(keys(2), [DISK])
    (write,) = c.take_writes()
    assert write.tier == DISK and write.snapshot and write.keys == keys(0)
    assert write.host_slots == second.slots, "the snapshot is of the slot the new block reuses"
    c.complete_write(write)
    assert c.lookup(keys(0)) == (1, 1)


def test_write_failure_leaves_nothing_below():
    c = chain()
    plan, (write,) = c.prepare_store(keys(0), [DISK])
    c.complete_store(plan.keys, writes=[write])
    c.complete_write(write, success=False)
    assert lower(c).state(keys(0)[0]) is BlockState.ABSENT
    assert c.host.loads_in_flight(keys(0)[0]) == 0


def test_a_full_lower_tier_skips_writes():
    c = chain(host_slots=4, lower_slots=2)
    plan, writes = c.prepare_store(keys(0, 1), [DISK])  # in flight: both lower slots storing
    _, none = c.prepare_store(keys(2), [DISK])
    assert none == [] and c.tier(DISK).skipped_writes == 1
    c.complete_store(plan.keys, writes=writes)
    for write in writes:
        c.complete_write(write)


def test_bad_input():
    with pytest.raises(ValidationError, match="write"):
        ChainTier(DISK, TierIndex(2), "sideways")  # type: ignore[arg-type]
    c = chain()
    with pytest.raises(BlockStateError, match="ready in no tier"):
        c.prepare_load(keys(7))
    store(c, keys(0, 1, 2, 3))
    store(c, keys(4, 5))  # 0 and 1 now live below only
    with pytest.raises(BlockStateError, match="listed twice"):
        c.prepare_load(keys(0, 0))
    with pytest.raises(BlockStateError, match="ready in no tier"):
        TierChain(OffloadingManager(2)).prepare_load(keys(7))


def test_a_store_with_nothing_below_plans_no_write(tmp_path):
    """No tier named: the host store is planned, the lower tier is neither written nor
    asked for room (a tier too slow to read is not written)."""
    chain = TierChain(OffloadingManager(4, "lru"), [ChainTier(DISK, TierIndex(4, "clock"), "through")])
    plan, writes = chain.prepare_store([b"a" * 32, b"b" * 32], tiers=())
    assert len(plan.keys) == 2 and writes == []
    assert lower(chain).lookup([b"a" * 32]) == 0 and chain.tier(DISK).skipped_writes == 0
    plan, writes = chain.prepare_store([b"c" * 32], tiers=[DISK])  # the negative control
    assert [(w.tier, w.keys) for w in writes] == [(DISK, [b"c" * 32])]


# -- a list of tiers ---------------------------------------------------------------------


def three(host_slots: int = 4, write: str = "through") -> TierChain:
    """Two local tiers, each with its own index (``ram``, then ``disk``), then a store (``redis``)."""
    tiers = [
        ChainTier("ram", TierIndex(8, "lru"), "through"),
        ChainTier(DISK, TierIndex(16, "lru"), write),  # type: ignore[arg-type]
        ChainTier("redis"),
    ]
    return TierChain(OffloadingManager(host_slots), tiers)


def evict_host(c: TierChain, fresh: list[bytes]) -> None:
    """Fill the host tier with ``fresh`` blocks written nowhere below."""
    store(c, fresh, tiers=())


def test_each_key_is_read_from_the_first_tier_holding_it():
    c = three(host_slots=4)
    store(c, keys(0, 1), tiers=("ram", DISK))  # on both local tiers
    store(c, keys(2), tiers=(DISK,))  # on the second only
    evict_host(c, keys(10, 11, 12, 13))
    assert c.host.lookup(keys(0)) == 0 and c.host.lookup(keys(2)) == 0
    assert lower(c, "ram").lookup(keys(0, 1)) == 2 and lower(c).lookup(keys(0, 1, 2)) == 3
    held = {"redis": set(keys(3))}  # what the store said it holds: key 3 only
    assert c.holder(keys(0)[0], held).name == "ram"
    assert c.holder(keys(2)[0], held).name == DISK
    assert c.holder(keys(3)[0], held).name == "redis"
    assert c.holder(keys(3)[0]) is None, "a store holds what it said it holds, nothing more"
    assert c.lookup(keys(0, 1, 2, 3), held) == (4, 4)
    assert c.lookup(keys(0, 1, 2, 3)) == (3, 3), "without the store's answer the hit ends at key 3"

    plan = c.prepare_load(keys(0, 1, 2, 3), held)
    assert plan is not None and plan.host_hits == []
    ram, disk, redis = plan.reads
    assert (ram.tier, ram.keys, ram.slots) == (
        "ram",
        keys(0, 1),
        [lower(c, "ram").slot(k) for k in keys(0, 1)],
    )
    assert (disk.tier, disk.keys, disk.slots) == (DISK, keys(2), [lower(c).slot(keys(2)[0])])
    assert (redis.tier, redis.keys, redis.slots) == ("redis", keys(3), []), "a store has no slots"
    where = dict(zip(plan.keys, plan.host_slots, strict=True))
    for read in plan.reads:
        assert read.host_slots == [where[k] for k in read.keys]
    assert lower(c, "ram").loads_in_flight(keys(0)[0]) == 1, "read from the first tier holding it"
    assert lower(c).loads_in_flight(keys(0)[0]) == 0, "not from a later tier that holds it too"
    assert lower(c).loads_in_flight(keys(2)[0]) == 1
    c.complete_load(plan)
    assert c.lookup(keys(0, 1, 2, 3)) == (4, 0)
    assert lower(c, "ram").loads_in_flight(keys(0)[0]) == 0 and lower(c).loads_in_flight(keys(2)[0]) == 0


def test_the_order_of_the_list_decides_who_serves():
    """The same blocks on a disk and in a store: whichever the list names first serves them."""
    for order, first in (((DISK, "redis"), DISK), (("redis", DISK), "redis")):
        by_name = {DISK: ChainTier(DISK, TierIndex(8, "lru")), "redis": ChainTier("redis")}
        c = TierChain(OffloadingManager(2), [by_name[name] for name in order])
        store(c, keys(0, 1))
        evict_host(c, keys(10, 11))
        plan = c.prepare_load(keys(0, 1), {"redis": set(keys(0, 1))})
        assert [(read.tier, read.keys) for read in plan.reads] == [(first, keys(0, 1))], order
        c.complete_load(plan)


def test_a_store_writes_through_to_exactly_the_tiers_named():
    c = three(host_slots=8)
    plan, writes = c.prepare_store(keys(0, 1), ["redis", DISK, "ram"])
    assert [w.tier for w in writes] == ["ram", DISK, "redis"], "one write per tier, in the chain's order"
    for write in writes:
        assert write.keys == keys(0, 1) and write.host_slots == plan.slots and not write.snapshot
    ram, disk, redis = writes
    assert ram.slots == [lower(c, "ram").slot(k) for k in keys(0, 1)]
    assert disk.slots == [lower(c).slot(k) for k in keys(0, 1)]
    assert redis.slots == [], "a store names its values by key"
    assert lower(c, "ram").state(keys(0)[0]) is BlockState.STORING
    assert lower(c).state(keys(0)[0]) is BlockState.STORING
    c.complete_store(plan.keys, writes=writes)
    assert c.host.loads_in_flight(keys(0)[0]) == 3, "each write pins the host slot until it ends"
    for write, left in zip(writes, (2, 1, 0), strict=True):
        c.complete_write(write)
        assert c.host.loads_in_flight(keys(0)[0]) == left
    assert lower(c, "ram").lookup(keys(0, 1)) == 2 and lower(c).lookup(keys(0, 1)) == 2

    plan, writes = c.prepare_store(keys(2), [DISK])
    assert [(w.tier, w.keys) for w in writes] == [(DISK, keys(2))]
    assert lower(c, "ram").state(keys(2)[0]) is BlockState.ABSENT, "a tier not named is not written"
    c.complete_store(plan.keys, writes=writes)
    c.complete_write(writes[0])
    plan, writes = c.prepare_store(keys(3), ["redis"])
    assert [(w.tier, w.keys, w.slots) for w in writes] == [("redis", keys(3), [])]
    assert lower(c, "ram").state(keys(3)[0]) is BlockState.ABSENT
    assert lower(c).state(keys(3)[0]) is BlockState.ABSENT


def test_write_back_is_queued_only_for_a_named_tier():
    c = three(host_slots=2, write="back")  # ram written through, disk written back
    store(c, keys(0, 1), tiers=("ram",))
    plan, writes = c.prepare_store(keys(2), ["ram"])  # evicts key 0
    assert [w.tier for w in writes] == ["ram"]
    assert c.take_writes() == [], "the write-back tier was not named: nothing queued for it"
    c.complete_store(plan.keys, writes=writes)
    c.complete_write(writes[0])
    plan, writes = c.prepare_store(keys(3), ["ram", DISK, "redis"])  # evicts key 1
    assert [w.tier for w in writes] == ["ram", "redis"], "a write-back tier is not written with the store"
    (back,) = c.take_writes()
    assert (back.tier, back.keys, back.snapshot) == (DISK, keys(1), True)
    assert back.host_slots == plan.slots, "the snapshot is of the slot the new block reuses"
    assert back.slots == [lower(c).slot(keys(1)[0])]
    c.complete_write(back)
    c.complete_store(plan.keys, writes=writes)
    for write in writes:
        c.complete_write(write)
    assert lower(c).lookup(keys(1)) == 1 and lower(c).lookup(keys(0)) == 0


def test_a_promotion_queues_write_back_for_every_write_back_tier():
    """What a load's promotions evict is written back whatever the last store named."""
    c = three(host_slots=2, write="back")
    store(c, keys(0, 1), tiers=("ram",))
    store(c, keys(2, 3), tiers=("ram",))  # evicts 0 and 1 (the disk not named: not written back)
    assert c.take_writes() == [] and lower(c).lookup(keys(0)) == 0
    plan = c.prepare_load(keys(0))  # from ram, into the slot of key 2
    (back,) = c.take_writes()
    assert (back.tier, back.keys, back.snapshot) == (DISK, keys(2), True)
    c.complete_write(back)
    c.complete_load(plan)
    assert lower(c).lookup(keys(2)) == 1


def test_a_failed_load_forgets_each_key_from_the_local_tier_it_came_from_only():
    c = three(host_slots=4)
    store(c, keys(0, 1), tiers=("ram", DISK))
    store(c, keys(2), tiers=(DISK,))
    evict_host(c, keys(10, 11, 12, 13))
    held = {"redis": set(keys(3))}
    plan = c.prepare_load(keys(0, 1, 2, 3), held)
    assert [read.tier for read in plan.reads] == ["ram", DISK, "redis"]
    c.complete_load(plan, success=False)
    for key in keys(0, 1, 2, 3):
        assert c.host.state(key) is BlockState.ABSENT
    assert lower(c, "ram").lookup(keys(0, 1)) == 0, "read from ram and failed: gone from ram"
    assert lower(c).state(keys(0)[0]) is BlockState.READY, "the disk's copy was never read: kept"
    assert lower(c).state(keys(1)[0]) is BlockState.READY
    assert lower(c).state(keys(2)[0]) is BlockState.ABSENT, "read from the disk and failed: gone from it"
    assert lower(c).loads_in_flight(keys(0)[0]) == 0 and lower(c, "ram").loads_in_flight(keys(0)[0]) == 0
    assert c.holder(keys(0)[0], held).name == DISK, "the next load of key 0 reads the disk's copy"
    assert c.lookup(keys(0, 1, 2), held) == (2, 2)


def test_tier_names_are_unique():
    with pytest.raises(ValidationError, match="unique"):
        TierChain(OffloadingManager(2), [ChainTier(DISK, TierIndex(2)), ChainTier(DISK)])
    with pytest.raises(ValidationError, match="unique"):
        TierChain(OffloadingManager(2), [ChainTier("redis"), ChainTier("redis")])
    TierChain(OffloadingManager(2), [ChainTier(DISK, TierIndex(2)), ChainTier("redis")])  # the control


def test_a_shared_tier_is_written_through():
    with pytest.raises(ValidationError, match="shared tier is written through"):
        ChainTier("redis", None, "back")
    assert ChainTier("redis").shared and ChainTier("redis").write == "through"
    assert not ChainTier(DISK, TierIndex(2), "back").shared  # the control: a local tier may be
